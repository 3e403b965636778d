"""Per-request sampling parameters."""

from __future__ import annotations

from dataclasses import dataclass

from .errors import MedusaError

ACCEPTANCE = ("greedy", "rejection", "typical")


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy. `acceptance` picks how speculative candidates are accepted when
    sampling: `rejection` keeps the target's distribution exactly, `typical` accepts more (not lossless)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    acceptance: str = "rejection"
    typical_epsilon: float = 0.3
    typical_delta: float = 0.09

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise MedusaError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise MedusaError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise MedusaError(f"top_k must be >= 0, got {self.top_k}")
        if self.acceptance not in ACCEPTANCE:
            raise MedusaError(f"acceptance must be one of {', '.join(ACCEPTANCE)}, got {self.acceptance!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.acceptance == "greedy"


GREEDY = SamplingParams()
