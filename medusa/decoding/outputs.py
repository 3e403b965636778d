"""What decoding returns: per-step output, finished sequences, log-probabilities, run statistics."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable

import torch

@dataclass
class Stats:
    forward_passes: int = 0
    steps: int = 0
    row_steps: int = 0
    verified_tokens: int = 0  # tokens the target verified, summed over row-steps (each row's root included)
    new_tokens: int = 0
    accept_hist: list[int] = field(default_factory=list)  # accept_hist[a]: row-steps accepting a candidates

    @property
    def mean_accepted(self) -> float:
        """tau: tokens produced per row per verification step (accepted candidates + the target's own)."""
        return sum((a + 1) * c for a, c in enumerate(self.accept_hist)) / max(self.row_steps, 1)

    @property
    def tokens_per_pass(self) -> float:
        """Tokens per row in a verification pass (1 for plain decoding; a tree's nodes + 1)."""
        return self.verified_tokens / max(self.row_steps, 1)

    def acceptance_by_head(self) -> list[float]:
        """P(candidate k accepted | candidates before it accepted), k = 0 .. depth-1."""
        h = self.accept_hist
        return [sum(h[k + 1:]) / max(sum(h[k:]), 1) for k in range(len(h) - 1)]

    def add_hist(self, accepted: list[int], width: int) -> None:
        """Count one step's per-row accepted candidates (host values); the histogram spans `width`."""
        need = max(width, max(accepted, default=-1) + 1)
        self.accept_hist += [0] * (need - len(self.accept_hist))
        for a in accepted:
            self.accept_hist[a] += 1


@dataclass
class Finished:
    id: Hashable
    tokens: list[int]
    reason: str  # "stop" (EOS) or "length"


MAX_TOP_LOGPROBS = 20


@dataclass
class TokenLogprobs:
    """The target's log-probabilities at each emitted position: log_softmax of its raw logits (before
    temperature, top-k/top-p), so they are the same whether or not the tokens came from speculation."""

    token: torch.Tensor       # [n, m] log-probability of the emitted token
    top_ids: torch.Tensor     # [n, m, k] the k most likely tokens (k = the most any row asked for)
    top: torch.Tensor         # [n, m, k] their log-probabilities


@dataclass
class StepOutput:
    ids: list[Hashable]       # request id of each row that took part, in row order
    tokens: torch.Tensor      # [n, m] new tokens per row (first `counts[r]` valid)
    counts: torch.Tensor      # [n]
    finished: list[Finished]
    # Only when a row asked for them (`Engine.add(..., logprobs=...)`); rows that did not ask get the
    # same values, which the caller ignores.
    logprobs: TokenLogprobs | None = None
    # [n] candidates the verifier accepted per row, before any EOS / max-token cut (0 after a prefill).
    accepted: torch.Tensor | None = None
    # `counts` and `accepted` as host lists, read in the step's one wait for the device: callers that
    # need the numbers (policies, the server's scheduler, progress bars) wait for nothing more.
    count_list: list[int] = field(default_factory=list)
    accepted_list: list[int] = field(default_factory=list)

    @property
    def tau(self) -> float:
        """Tokens per row the step's verification produced (1 + candidates accepted, before any EOS or
        max-token cut): the one measure of acceptance that auto mode, the server's policy and the metrics
        share. 1.0 for a plain step."""
        return 1 + sum(self.accepted_list) / max(len(self.accepted_list), 1)


@dataclass
class Generation:
    outputs: list[Finished]
    stats: Stats
    seconds: float
    mode: str

    @property
    def tokens_per_s(self) -> float:
        return self.stats.new_tokens / max(self.seconds, 1e-9)


def token_logprobs(logits: torch.Tensor, new: torch.Tensor, k: int) -> TokenLogprobs:
    """logits [n, m, V] that decided tokens new [n, m] -> their log-probabilities and the top k."""
    lp = torch.log_softmax(logits.float(), -1)
    top = lp.topk(k, -1) if k else None
    empty = lp.new_zeros(*new.shape, 0)
    return TokenLogprobs(lp.gather(-1, new[..., None])[..., 0],
                         top.indices if top is not None else empty.long(),
                         top.values if top is not None else empty)
