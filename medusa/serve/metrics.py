"""Prometheus metrics of one server instance (own registry, so several apps can live in one process)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from medusa.serve.errors import OUTCOMES

if TYPE_CHECKING:
    from medusa.decoding.proposers import Proposer

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30, 60)
FAILURE_STAGES = ("prefill", "row", "proposer", "engine")


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.running = Gauge("medusa_requests_running", "Requests decoding in the batch", registry=r)
        self.queued = Gauge("medusa_requests_queued", "Requests waiting for a batch slot", registry=r)
        self.requests = Counter("medusa_requests", "Finished requests by finish reason", ["reason"],
                                registry=r)
        self.rejected = Counter("medusa_requests_rejected", "Requests refused by cause", ["cause"],
                                registry=r)
        self.responses = Counter("medusa_responses", "HTTP requests by outcome: ok, cancelled, or the error "
                                 "kind (bad_request, malformed, unauthorized, forbidden, not_found, "
                                 "method_not_allowed, too_large, unsupported_media_type, headers_too_large, "
                                 "queue_full, queue_timeout, unavailable, server_error, client_error)", ["outcome"],
                                 registry=r)
        self.failures = Counter("medusa_failures", "Internal failures by stage: prefill, row (tokens of one "
                                "request), proposer (step redone without speculation), engine (batch failed)",
                                ["stage"], registry=r)
        self.healthy = Gauge("medusa_engine_healthy", "0 after a failed decoding step until one succeeds",
                             registry=r)
        self.healthy.set(1)
        # Every label exists from the start: a series that appears only at the first failure hides the
        # moment it went from 0 to 1 from rate() and alerts.
        for stage in FAILURE_STAGES:
            self.failures.labels(stage)
        for outcome in OUTCOMES:
            self.responses.labels(outcome)
        self.prompt_tokens = Counter("medusa_prompt_tokens", "Prompt tokens prefilled", registry=r)
        self.prefill_chunks = Counter("medusa_prefill_chunks", "Prefill passes over a chunk of a long prompt "
                                      "(between the running rows' steps)", registry=r)
        self.tokens = Counter("medusa_generated_tokens", "Completion tokens generated", registry=r)
        self.ttft = Histogram("medusa_time_to_first_token_seconds", "Arrival to first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("medusa_time_per_output_token_seconds",
                              "Per request: (last token - first token) / (tokens - 1)",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.steps = Counter("medusa_steps", "Engine decode steps by speculation mode", ["mode"], registry=r)
        self.spec_steps = Counter("medusa_speculation_steps", "Decode steps with speculation on/off",
                                  ["state"], registry=r)
        self.step_seconds = Histogram("medusa_step_seconds", "Duration of one decode step",
                                      buckets=LATENCY_BUCKETS, registry=r)
        # Speculation outcome as counters, so rate() over any window gives tau and the acceptance rate:
        # tau = 1 + rate(accepted) / rate(row_steps); acceptance = rate(accepted) / rate(depth).
        self.spec_row_steps = Counter("medusa_speculative_row_steps", "Rows verified in speculative steps",
                                      registry=r)
        self.spec_accepted = Counter("medusa_accepted_tokens",
                                     "Candidates accepted and emitted in speculative steps", registry=r)
        self.spec_depth = Counter("medusa_proposed_depth_tokens",
                                  "Rows x proposal depth (the most a row could accept) in speculative steps",
                                  registry=r)
        self.accepted = Gauge("medusa_mean_accepted_tokens",
                              "Tokens per row per speculative step (tau), since start", registry=r)
        self.acceptance = Gauge("medusa_acceptance_rate",
                                "Accepted candidates / proposal depth, since start (rate() of "
                                "medusa_accepted_tokens_total / medusa_proposed_depth_tokens_total for a window)",
                                registry=r)
        # vLLM's names for the same quantities, so dashboards built for vLLM read this server unchanged.
        # A draft is one row's proposal in one step; its draft tokens are the candidates verified (the tree's
        # nodes, for a chain its length); position p counts drafts that accepted more than p tokens.
        self.vllm_drafts = Counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", registry=r)
        self.vllm_draft_tokens = Counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.",
                                         registry=r)
        self.vllm_accepted = Counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.",
                                     registry=r)
        self.vllm_per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                    "Accepted tokens per draft position.", ["position"], registry=r)
        self.vllm_ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in "
                                   "seconds.", buckets=LATENCY_BUCKETS, registry=r)
        self.vllm_itl = Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in "
                                  "seconds (between a request's successive token deliveries).",
                                  buckets=LATENCY_BUCKETS, registry=r)
        # The prefix cache (medusa.serve.prefix): lookups and hits counted per prompt, tokens per position.
        self.prefix_lookups = Counter("medusa_prefix_cache_lookups", "Prompts looked up in the prefix cache",
                                      registry=r)
        self.prefix_hits = Counter("medusa_prefix_cache_hits", "Prompt lookups that found a cached prefix",
                                   registry=r)
        self.prefix_hit_rate = Gauge("medusa_prefix_cache_hit_rate", "Prefix cache hits / lookups, since start",
                                     registry=r)
        self.prefix_cached_tokens = Counter("medusa_prefix_cache_cached_tokens",
                                            "Prompt tokens served from the prefix cache (not prefilled)",
                                            registry=r)
        self.prefix_evictions = Counter("medusa_prefix_cache_evictions", "Prefix cache blocks evicted",
                                        registry=r)
        self.prefix_bytes = Gauge("medusa_prefix_cache_bytes", "Bytes held by cached prefix blocks", registry=r)
        self.prefix_capacity = Gauge("medusa_prefix_cache_capacity_bytes",
                                     "The prefix cache's budget (whole blocks); 0 when it is off", registry=r)
        self.prefix_blocks = Gauge("medusa_prefix_cache_blocks", "Cached prefix blocks", registry=r)
        self.prefix_held = Gauge("medusa_prefix_cache_held_blocks",
                                 "Cached prefix blocks that running requests hold (never evicted)", registry=r)
        self.vllm_prefix_queries = Counter("vllm:prefix_cache_queries",
                                           "Prefix cache queries, in terms of number of queried tokens.",
                                           registry=r)
        self.vllm_prefix_hits = Counter("vllm:prefix_cache_hits",
                                        "Prefix cache hits, in terms of number of cached tokens.", registry=r)
        # The latency target (medusa.serve.prefill): whether running streams' steps keep it.
        self.tpot_target = Gauge("medusa_tpot_target_seconds", "Step-time target running streams keep "
                                 "while prompts are prefilled (--tpot-slo); 0 when none", registry=r)
        self.tpot_missed = Gauge("medusa_tpot_target_missed", "1 while the running rows' decode step alone "
                                 "takes longer than the target (more streams than it allows)", registry=r)
        self.tpot_missed_total = Counter("medusa_tpot_target_missed_spells", "Times the target became "
                                         "unkeepable (a spell of steps over it)", registry=r)
        self._row_steps = self._accepted_sum = self._depth_sum = 0
        self.spec_on = Gauge("medusa_speculation_on", "1 when the last step speculated", registry=r)
        self.mode_info = Gauge("medusa_speculation_mode", "1 for the mode of the last step", ["mode"],
                               registry=r)

    def observe_step(self, mode: str, modes, seconds: float, accepted: list[int] | None = None,
                     proposer: "Proposer | None" = None) -> None:
        """One decode step in `mode` (one of `modes`); `accepted` and the `proposer` for a speculative one."""
        self.step_seconds.observe(seconds)
        self.steps.labels(mode).inc()
        self.spec_steps.labels("on" if proposer is not None else "off").inc()
        self.spec_on.set(1 if proposer is not None else 0)
        for m in modes:
            self.mode_info.labels(m).set(1 if m == mode else 0)
        if proposer is not None:
            self.observe_drafts(accepted, proposer.max_nodes - 1, proposer.max_depth)

    def observe_target(self, target_ms: float | None, missed: bool, was_missed: bool) -> bool:
        """The step-time target in force and whether it is kept; a spell of misses is counted once, when
        it starts. Returns `missed` (the caller's state for the next boundary)."""
        if target_ms is not None:
            self.tpot_target.set(target_ms / 1000)
        if missed != was_missed:
            self.tpot_missed.set(1 if missed else 0)
            if missed:
                self.tpot_missed_total.inc()
        return missed

    def observe_drafts(self, accepted: list[int], draft_tokens: int, depth: int) -> None:
        """One speculative step: `accepted[r]` candidates emitted by row r, each row's proposal having
        `draft_tokens` candidates at most `depth` deep."""
        rows, total = len(accepted), sum(accepted)
        self.spec_row_steps.inc(rows)
        self.spec_accepted.inc(total)
        self.spec_depth.inc(rows * depth)
        self.vllm_drafts.inc(rows)
        self.vllm_draft_tokens.inc(rows * draft_tokens)
        self.vllm_accepted.inc(total)
        for p in range(depth):
            self.vllm_per_pos.labels(str(p)).inc(sum(1 for a in accepted if a > p))
        self._row_steps += rows
        self._accepted_sum += total
        self._depth_sum += rows * depth
        self.accepted.set(1 + self._accepted_sum / self._row_steps)
        self.acceptance.set(self._accepted_sum / max(self._depth_sum, 1))

    def observe_first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)
        self.vllm_ttft.observe(seconds)

    def observe_inter_token(self, seconds: float) -> None:
        self.vllm_itl.observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)
