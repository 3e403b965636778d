"""Prometheus metrics of one server instance (own registry, so several apps can live in one process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30, 60)
FAILURE_STAGES = ("prefill", "row", "proposer", "engine")
OUTCOMES = ("ok", "cancelled", "bad_request", "not_found", "method_not_allowed", "too_large", "queue_full",
            "queue_timeout", "unavailable", "server_error")


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
                                 "kind (bad_request, not_found, method_not_allowed, too_large, queue_full, "
                                 "queue_timeout, unavailable, server_error)", ["outcome"], registry=r)
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
        self.accepted = Gauge("medusa_mean_accepted_tokens",
                              "Tokens per row per speculative step (tau), mean since start",
                              registry=r)
        self.acceptance = Gauge("medusa_acceptance_rate",
                                "Accepted candidates / proposed depth over speculative steps", registry=r)
        self.spec_on = Gauge("medusa_speculation_on", "1 when the last step speculated", registry=r)
        self.mode_info = Gauge("medusa_speculation_mode", "1 for the mode of the last step", ["mode"],
                               registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
