"""Per-request sampling parameters."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from medusa.decoding.verifier import ACCEPT_GREEDY, ACCEPT_MATCH, ACCEPT_REJECTION, ACCEPT_TYPICAL, argmax
from medusa.errors import MedusaError

ACCEPTANCE = ("greedy", "rejection", "typical")


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy. `acceptance` picks how speculative candidates are accepted when
    sampling: `rejection` keeps the target's distribution exactly, `typical` accepts more (not lossless).

    With a `seed`, rejection acceptance is done by matching (`ACCEPT_MATCH`): the token at each output position
    is drawn with a uniform that depends on (seed, position) only, and a candidate is accepted when it equals
    that draw. The text then depends on the seed and the logits alone, not on whether or how the step
    speculated."""

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


# ---- per-row sampling state ---------------------------------------------------------------------------

KEYED_BLOCK = 256  # a seeded row's uniforms are drawn this many at a time


def acceptance_of(p: SamplingParams) -> int:
    """The acceptance rule a row with these parameters follows."""
    if p.greedy:
        return ACCEPT_GREEDY
    if p.acceptance == "typical":
        return ACCEPT_TYPICAL
    return ACCEPT_MATCH if p.seed is not None else ACCEPT_REJECTION


class KeyedUniforms:
    """A seeded row's uniforms by output position: the one for position t is the t-th draw of a generator
    seeded with the row's seed, a function of (seed, t) alone, however many steps the row took to get there."""

    def __init__(self, seed: int):
        self.gen = torch.Generator().manual_seed(seed)
        self.values = torch.empty(0)

    def at(self, positions: torch.Tensor) -> torch.Tensor:
        """positions (long, CPU, any shape) -> their uniforms in [0, 1), same shape (CPU)."""
        need = int(positions.max()) + 1 if positions.numel() else 0
        if need > len(self.values):
            blocks = -(-(need - len(self.values)) // KEYED_BLOCK)
            self.values = torch.cat([self.values, torch.rand(blocks * KEYED_BLOCK, generator=self.gen)])
        return self.values[positions]


class RowSampling:
    """Sampling parameters of every row of a batch as tensors, so a step treats all rows at once.

    Rows with a seed draw keyed uniforms (`KeyedUniforms`, indexed by the row's output position, which
    `emitted` keeps on the host); the others share the batch's generator.
    """

    def __init__(self, rows: int, device: torch.device):
        self.device = device
        self.temperature = torch.zeros(rows, device=device)
        self.top_p = torch.ones(rows, device=device)
        self.top_k = torch.zeros(rows, dtype=torch.long, device=device)
        self.acceptance = torch.zeros(rows, dtype=torch.long, device=device)
        self.epsilon = torch.zeros(rows, device=device)
        self.delta = torch.zeros(rows, device=device)
        self.keyed: list[KeyedUniforms | None] = [None] * rows
        self.position = [0] * rows  # output tokens each row has emitted (host side: no device read)
        self.shared = torch.Generator(device=device)
        self.shared.seed()

    def set(self, rows: slice, params: list[SamplingParams]) -> None:
        self.temperature[rows] = torch.tensor([p.temperature for p in params], device=self.device)
        self.top_p[rows] = torch.tensor([p.top_p for p in params], device=self.device)
        self.top_k[rows] = torch.tensor([p.top_k for p in params], device=self.device)
        self.acceptance[rows] = torch.tensor([acceptance_of(p) for p in params], device=self.device)
        self.epsilon[rows] = torch.tensor([p.typical_epsilon for p in params], device=self.device)
        self.delta[rows] = torch.tensor([p.typical_delta for p in params], device=self.device)
        for r, p in zip(range(rows.start, rows.stop), params):
            self.keyed[r] = None if p.seed is None or p.greedy else KeyedUniforms(p.seed)
            self.position[r] = 0

    def move_rows(self, src: list[int], dst: list[int]) -> None:
        s, d = torch.tensor(src, device=self.device), torch.tensor(dst, device=self.device)
        for t in (self.temperature, self.top_p, self.top_k, self.acceptance, self.epsilon, self.delta):
            t[d] = t[s]
        for a, b in zip(src, dst):
            self.keyed[b], self.position[b] = self.keyed[a], self.position[a]

    def emitted(self, rows: slice, counts: list[int]) -> None:
        """The rows emitted `counts` more output tokens (read on the host by the step's one device read)."""
        for r, c in zip(range(rows.start or 0, rows.stop), counts):
            self.position[r] += c

    def any_sampling(self, rows: slice) -> bool:
        return bool((self.acceptance[rows] != ACCEPT_GREEDY).any())

    def uniform(self, rows: slice, m: int) -> torch.Tensor:
        """[n, m] uniforms in [0, 1) from the batch's shared generator (rows that are not keyed)."""
        return torch.rand(rows.stop - (rows.start or 0), m, generator=self.shared, device=self.device)

    def uniform_at(self, rows: slice, offsets: torch.Tensor) -> torch.Tensor:
        """offsets [n, ...] (long) -> uniforms [n, ...]: a keyed row's for its output positions `position +
        offsets`, fresh shared draws for the others."""
        u = torch.rand(offsets.shape, generator=self.shared, device=self.device)
        host = None
        for i, r in enumerate(range(rows.start or 0, rows.stop)):
            keyed = self.keyed[r]
            if keyed is not None:  # only keyed rows cost a Python iteration (and one read of the offsets)
                host = offsets.cpu() if host is None else host
                u[i] = keyed.at(host[i] + self.position[r]).to(self.device)
        return u

    def probs(self, logits: torch.Tensor, rows: slice) -> torch.Tensor:
        """Target sampling distribution per row and position: temperature, then top-k, then top-p.

        logits [n, T, V] -> probabilities [n, T, V] (float32). Greedy rows get a one-hot on the argmax so
        every acceptance rule reduces to greedy acceptance for them.
        """
        temp = self.temperature[rows].clamp(min=1e-5)[:, None, None]
        x = logits.float() / temp
        top_k, top_p = self.top_k[rows], self.top_p[rows]
        if bool((top_k > 0).any()):
            k = torch.where(top_k > 0, top_k, x.shape[-1]).clamp(max=x.shape[-1])
            kth = x.sort(-1, descending=True).values.gather(-1, (k - 1)[:, None, None].expand(*x.shape[:2], 1))
            x = x.masked_fill(x < kth, float("-inf"))
        p = torch.softmax(x, -1)
        if bool((top_p < 1).any()):
            sorted_p, order = p.sort(-1, descending=True)
            before = sorted_p.cumsum(-1) - sorted_p  # mass strictly before each token
            drop = before >= top_p[:, None, None]  # keeps the smallest prefix reaching top_p (>= 1 token)
            p = p.scatter(-1, order, sorted_p.masked_fill(drop, 0.0))
            p = p / p.sum(-1, keepdim=True)
        greedy = self.acceptance[rows] == ACCEPT_GREEDY
        if bool(greedy.any()):
            onehot = torch.nn.functional.one_hot(argmax(logits), logits.shape[-1]).float()
            p = torch.where(greedy[:, None, None], onehot, p)
        return p
