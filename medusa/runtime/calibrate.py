"""This machine's pass-cost curve: measured once per (model, dtype, device, threads, machine), then cached.

Whether a tree of N candidates pays depends on what one target pass over N+1 tokens per row costs next to
a one-token pass, and that ratio differs by an order of magnitude between machines: ~1.2x for 8 nodes on a
CPU with native bf16, ~5x on an AVX2 CPU in bf16 (emulated), close to 1x on a GPU. So the first use times
one pass for 1..64 tokens per row at the batch sizes that matter (a few seconds, with a progress bar) and
keeps the curve as JSON under `<cache>/calibration/`. `--mode auto`, the server's dynamic policy and the
evaluator's cost model all read that one file; `medusa calibrate` measures it on demand.

A curve measured while other work held the cores is wrong in shape, not just slower: small passes suffer the
most from contention, so every larger pass looks cheap next to them and trees look free. Each process therefore
times one one-token pass before it trusts a cached curve (`measured_busier`): when that pass now runs in less
than BUSIER times the cached one-token time, the curve was measured on a busier machine than this one is now,
and it is measured again. The rule is one-sided on purpose: a machine busier now than then keeps the quieter
curve, the better guess of what the machine does when it is free.
"""

from __future__ import annotations

import hashlib
import json
import sys
from bisect import bisect_left
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from medusa.io import write_text_atomic
from medusa.runtime.timing import measure_forward, measure_heads

VERSION = 4  # bump when what is measured changes, so old files are not read as new ones
TOKENS = [1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 48, 64]
BATCH_SIZES = [1, 2, 4, 8, 16]
# A batch size's sweep stops once a pass costs this many one-token passes: heads of depth <= 5 accept at
# most 6 tokens per step, so no tree past that point can pay.
STOP_RATIO = 6.0
PREFIX = 256
REPEATS = 5
HEADS_TOPK = 10
# A feature head's draft passes the planner prices: the catch-up pass (2 entries per row) and one expansion
# of every top-k a candidate shape uses (`dynamic_tree.shape_candidates`: min(8, nodes)).
DRAFT_TOKENS = [1, 2, 3, 4, 6, 8]
# Two shapes whose whole draft steps are timed per batch size (`timing.draft_step_ms`): what they cost beyond
# their head passes is the host work of a draft step, split into a fixed part and a part per expansion.
HOST_SHAPES = [(4, 2, 4), (8, 4, 4)]  # (nodes, depth, topk)
BUSIER = 0.6  # a cached one-token pass more than 1/BUSIER (~1.7x) as slow as one timed now: measure again
_trusted: set[Path] = set()  # cached curves already checked by this process


@dataclass
class Calibration:
    """grid[(B, T)] = ms of one target pass (with the lm_head) over T tokens per row for B rows."""

    key: dict
    grid: dict[tuple[int, int], float] = field(default_factory=dict)
    heads_ms: dict[int, float] = field(default_factory=dict)
    path: Path | None = None
    # drafts[head][(B, T)] = ms of one feature-head pass over T entries per row for B rows (with its
    # draft-vocabulary softmax and top-k), per feature-head architecture (`draft_key`), measured beside the
    # target's curve so a plan never times anything.
    drafts: dict[str, dict[tuple[int, int], float]] = field(default_factory=dict)
    # host[proposer][B] = (fixed, per expansion) ms a feature head's draft step spends beyond its passes at B
    # rows (`host_key`: the head's architecture, with retrieval grafted in or not), from whole draft steps.
    host: dict[str, dict[int, tuple[float, float]]] = field(default_factory=dict)

    def batch_sizes(self) -> list[int]:
        return sorted({b for b, _ in self.grid})

    def tokens(self, b: int) -> list[int]:
        return sorted(t for bb, t in self.grid if bb == b)

    def _nearest_batch(self, b: int) -> int:
        """The smallest measured batch size >= b (the largest if none): a larger batch makes extra tokens
        relatively dearer, so reading its curve errs against speculation, never for it."""
        sizes = self.batch_sizes()
        i = bisect_left(sizes, b)
        return sizes[min(i, len(sizes) - 1)]

    def ms(self, b: int, t: int) -> float:
        """Measured where possible; linear in T between (and past) the measured points of the nearest
        measured batch size, scaled to b rows by the one-token cost ratio when b itself was not measured."""
        if (b, t) in self.grid:
            return self.grid[(b, t)]
        nb = self._nearest_batch(b)
        ts = self.tokens(nb)
        i = min(max(bisect_left(ts, t), 1), len(ts) - 1)
        if len(ts) == 1:
            value = self.grid[(nb, ts[0])] * t / ts[0]
        else:
            t0, t1 = ts[i - 1], ts[i]
            m0, m1 = self.grid[(nb, t0)], self.grid[(nb, t1)]
            value = m0 + (m1 - m0) * (t - t0) / (t1 - t0)
        if nb != b and (b, 1) in self.grid:
            value *= self.grid[(b, 1)] / self.grid[(nb, 1)]
        return max(value, 1e-6)

    def ratio(self, b: int, t: int) -> float:
        """Cost of a T-token pass over a one-token pass at batch size b (the number speculation must beat)."""
        return self.ms(b, t) / self.ms(b, 1)

    def plain_scale(self, b: int, ref: int) -> float:
        """A one-token pass at b rows over one at `ref` rows (how the acceptance gate carries a plain step's
        measured cost from one batch size to another)."""
        return self.ms(b, 1) / self.ms(ref, 1)

    def heads(self, b: int) -> float:
        from medusa.runtime.timing import heads_ms

        return heads_ms(self.heads_ms, b)

    def draft_ms(self, head: str, b: int, t: int) -> float:
        """One draft pass of `head` over `t` entries per row at `b` rows: measured where possible, else
        linear in B between the measured batch sizes of the nearest measured T at or above `t`."""
        from medusa.runtime.timing import heads_ms

        grid = self.drafts[head]
        if (b, t) in grid:
            return grid[(b, t)]
        ts = sorted({tt for _, tt in grid})
        tt = ts[min(bisect_left(ts, t), len(ts) - 1)]
        return heads_ms({bb: ms for (bb, t2), ms in grid.items() if t2 == tt}, b)

    def draft_ratio(self, head: str, b: int, t: int) -> float:
        """A draft pass as a multiple of a one-token target pass at `b` rows (both from this curve)."""
        return self.draft_ms(head, b, t) / self.ms(b, 1)

    def host_ms(self, key: str, b: int, depth: int) -> float:
        """The host work of a draft step `depth` deep at `b` rows beyond its head passes (0 where none was
        measured), linear in B between measured batch sizes."""
        from medusa.runtime.timing import heads_ms

        measured = self.host.get(key) or {}
        fixed = heads_ms({bb: f for bb, (f, _) in measured.items()}, b)
        per = heads_ms({bb: p for bb, (_, p) in measured.items()}, b)
        return fixed + per * (depth - 1)

    def drafting(self, head: str, host: str, b: int, depth: int, topk: int) -> float:
        """A whole draft step in one-token target passes at `b` rows: the catch-up pass (2 entries per row),
        depth - 1 expansions over the top-k frontier, and the host work around them."""
        passes = self.draft_ms(head, b, 2) + (depth - 1) * self.draft_ms(head, b, topk)
        return (passes + self.host_ms(host, b, depth)) / self.ms(b, 1)

    def to_dict(self) -> dict:
        return {"version": VERSION, "key": self.key,
                "grid": [[b, t, ms] for (b, t), ms in sorted(self.grid.items())],
                "heads_ms": {str(b): ms for b, ms in sorted(self.heads_ms.items())},
                "drafts": {k: [[b, t, ms] for (b, t), ms in sorted(g.items())] for k, g in self.drafts.items()},
                "host": {k: [[b, f, p] for b, (f, p) in sorted(g.items())] for k, g in self.host.items()}}

    @classmethod
    def from_dict(cls, d: dict, path: Path | None = None) -> "Calibration":
        drafts = {k: {(int(b), int(t)): float(ms) for b, t, ms in g} for k, g in d.get("drafts", {}).items()}
        host = {k: {int(b): (float(f), float(p)) for b, f, p in g} for k, g in d.get("host", {}).items()}
        return cls(d["key"], {(int(b), int(t)): float(ms) for b, t, ms in d["grid"]},
                   {int(b): float(ms) for b, ms in d.get("heads_ms", {}).items()}, path, drafts, host)


def draft_key(head) -> str:
    """What a feature-head pass's cost depends on: its architecture, not its weights."""
    c = head.config
    return json.dumps([c.style, c.hidden_size, c.draft_vocab, c.feature_dim, c.own_lm_head])


def host_key(rt) -> str:
    """What a feature-head draft step's host work depends on: the head's architecture and whether retrieval
    is grafted into its trees (auto mode grafts it unless `--retrieval off`)."""
    return draft_key(rt.feature) + ("+retrieval" if rt.retrieval else "")


def calibration_key(rt) -> dict:
    """What a pass's cost depends on: the model's shape, the dtype, the device, the threads, the machine, and
    whether attention is batch-invariant (its own, dearer kernels)."""
    cfg = rt.hf_model.config
    heads = rt.heads.config if rt.heads is not None else None
    return {"model": str(getattr(rt.hf_model, "name_or_path", "")),
            "shape": [cfg.hidden_size, cfg.num_hidden_layers, cfg.intermediate_size, cfg.vocab_size,
                      cfg.num_attention_heads, cfg.num_key_value_heads],
            "dtype": rt.dtype.name, "machine": rt.machine.to_dict(), "torch": torch.__version__,
            "heads": None if heads is None else [heads.num_heads, heads.num_layers, heads.candidates],
            **({"batch_invariant": True} if rt.model.invariant else {})}


def calibration_path(key: dict) -> Path:
    from medusa.io import cache_dir

    digest = hashlib.sha256(json.dumps([VERSION, key], sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / "calibration" / f"{digest}.json"


def cached_curve(rt) -> Callable[[int, int], float] | None:
    """This machine's calibrated pass time `ms(rows, tokens)` for the runtime's model when one is cached
    (nothing is measured), else None."""
    path = calibration_path(calibration_key(rt))
    try:
        cal = Calibration.from_dict(json.loads(path.read_text()), path)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return cal.ms if cal.grid else None


def load_or_measure(rt, batch_sizes: list[int] | None = None, tokens: list[int] | None = None,
                    force: bool = False, progress: bool = True) -> Calibration:
    """The cached curve, measuring only what it lacks. Without `tokens`, a missing batch size is swept over
    TOKENS up to STOP_RATIO; with `tokens` (the evaluator's grid), exactly those points are added."""
    key = calibration_key(rt)
    path = calibration_path(key)
    cal = Calibration(key, path=path)
    if path.is_file() and not force:
        try:
            cal = Calibration.from_dict(json.loads(path.read_text()), path)
        except (ValueError, KeyError, TypeError):
            cal = Calibration(key, path=path)  # a damaged cache file is measured again
        if measured_busier(rt, cal):
            cal = Calibration(key, path=path)
    wanted = sorted(set(batch_sizes or BATCH_SIZES))
    if tokens is None:
        todo = {b: TOKENS for b in wanted if b not in cal.batch_sizes()}
    else:
        todo = {b: [t for t in sorted(set(tokens) | {1}) if (b, t) not in cal.grid] for b in wanted}
        todo = {b: ts for b, ts in todo.items() if ts}
    heads_todo = [b for b in wanted if rt.heads is not None and b not in cal.heads_ms]
    drafted = cal.drafts.get(draft_key(rt.feature), {}) if rt.feature is not None else {}
    hosted = cal.host.get(host_key(rt), {}) if rt.feature is not None else {}
    drafts_todo = [b for b in wanted if rt.feature is not None and ((b, DRAFT_TOKENS[0]) not in drafted
                                                                    or b not in hosted)]
    if not todo and not heads_todo and not drafts_todo:
        return cal
    _measure(rt, cal, todo, heads_todo, drafts_todo, stop=tokens is None, progress=progress)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(cal.to_dict(), indent=1))
    _trusted.add(path)
    return cal


def measured_busier(rt, cal: Calibration) -> bool:
    """Whether the cached curve `cal` was measured on a busier machine than this one is now (see the module's
    docstring); checked once per curve and process, on its smallest batch size, and said on stderr when so."""
    if cal.path is None or cal.path in _trusted or not cal.grid:
        return False
    from medusa.runtime.timing import target_pass_ms

    _trusted.add(cal.path)
    rows = cal.batch_sizes()[0]
    then = cal.grid.get((rows, 1))
    if then is None:
        return False
    now = target_pass_ms(rt.model, rows, repeats=3)
    if now >= BUSIER * then:
        return False
    print(f"the pass-cost curve {cal.path} was measured on a busier machine (a one-token pass at batch size "
          f"{rows}: {then:.1f} ms then, {now:.1f} ms now); measuring it again", file=sys.stderr)
    return True


def _measure(rt, cal: Calibration, todo: dict[int, list[int]], heads_todo: list[int], drafts_todo: list[int],
             stop: bool, progress: bool) -> None:
    from tqdm import tqdm

    total = (sum(len(ts) for ts in todo.values()) + len(heads_todo)
             + len(drafts_todo) * (len(DRAFT_TOKENS) + len(HOST_SHAPES)))
    with tqdm(total=total, desc="calibrating pass cost", unit="pass", file=sys.stderr,
              disable=not progress) as bar:
        for b, ts in todo.items():
            ts = sorted(set(ts) | ({1} if stop else set()))
            for bb, t, ms in measure_forward(rt.model, [b], ts, PREFIX, REPEATS, bar,
                                             stop_ratio=STOP_RATIO if stop else None):
                cal.grid[(bb, t)] = ms
            _monotone(cal, b)
        if heads_todo:
            cal.heads_ms.update(measure_heads(rt.heads, rt.model.config.hidden_size, heads_todo, HEADS_TOPK,
                                              rt.model.dtype, rt.model.device, REPEATS, rt.model.lm_head))
            bar.update(len(heads_todo))
        if drafts_todo:
            from medusa.runtime.timing import draft_pass_ms
            from medusa.runtime.feature import runner_for

            runner, grid = runner_for(rt), cal.drafts.setdefault(draft_key(rt.feature), {})
            host = cal.host.setdefault(host_key(rt), {})
            for b in drafts_todo:
                for t in DRAFT_TOKENS:
                    grid[(b, t)] = draft_pass_ms(runner, b, t, PREFIX, REPEATS)
                    bar.update(1)
                host[b] = _host_work(rt, b, grid, bar)


def _host_work(rt, b: int, grid: dict[tuple[int, int], float], bar) -> tuple[float, float]:
    """(fixed, per expansion) ms of a feature-head draft step's host work at `b` rows: each HOST_SHAPES
    shape's whole draft step, timed in the engine, less its head passes (`grid`), fitted over the two depths
    (both parts kept >= 0)."""
    from medusa.decoding.trees.dynamic_tree import TreeShape
    from medusa.runtime.feature import draft_proposer
    from medusa.runtime.timing import draft_step_ms

    extra = []
    for nodes, depth, topk in HOST_SHAPES:
        step = draft_step_ms(rt.engine, draft_proposer(rt, TreeShape(nodes, depth, topk)), b, PREFIX)
        extra.append((depth, max(step - grid[(b, 2)] - (depth - 1) * grid[(b, topk)], 0.0)))
        bar.update(1)
    (d0, e0), (d1, e1) = extra
    per = max((e1 - e0) / (d1 - d0), 0.0)
    return max(e0 - per * (d0 - 1), 0.0), per


def _monotone(cal: Calibration, b: int) -> None:
    """More tokens per row never cost less: a point measured below a smaller T's time (noise, or a kernel
    that happens to suit that shape) takes that time, so no tree looks cheaper than a smaller one."""
    floor = 0.0
    for t in cal.tokens(b):
        floor = max(floor, cal.grid[(b, t)])
        cal.grid[(b, t)] = floor


def curve_table(cal: Calibration) -> str:
    """The curve as text: one line per batch size, ms of a one-token pass and each T's cost ratio."""
    lines = []
    for b in cal.batch_sizes():
        one = cal.grid[(b, 1)]
        cells = "  ".join(f"{t}:{cal.grid[(b, t)] / one:.2f}x" for t in cal.tokens(b) if t > 1)
        lines.append(f"  B={b:<3d} 1 token {one:7.1f} ms   {cells}")
    return "\n".join(lines)


def add_parser(sub) -> None:
    from medusa.runtime.args import add_model_args, int_list

    p = sub.add_parser("calibrate", help="measure (or show the cached) pass-cost curve of this machine and "
                                         "what --mode auto does with it")
    add_model_args(p)
    p.add_argument("--batch-sizes", type=int_list, default=BATCH_SIZES, help="comma-separated, e.g. 1,2,4")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--force", action="store_true", help="measure again even if a cached curve exists")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def run(args) -> int:
    from medusa.runtime import Runtime

    sizes = args.batch_sizes
    if args.threads:
        torch.set_num_threads(args.threads)
    rt = Runtime.load(args.model, args.heads, args.dtype, args.device, batch_invariant=args.batch_invariant == "on")
    cal = load_or_measure(rt, sizes, force=args.force, progress=not args.json)
    auto = rt.auto(max(sizes), progress=False)
    plans = [auto.plan(b).to_dict() for b in sizes] if auto is not None else []
    if args.json:
        print(json.dumps({"path": str(cal.path), **cal.to_dict(), "auto": plans}))
        return 0
    print(f"machine: {rt.machine.describe()}, dtype {rt.dtype.name} ({rt.dtype.reason})")
    print(f"curve ({cal.path}): one target pass over T tokens per row, as a multiple of a 1-token pass")
    print(curve_table(cal))
    if rt.feature is not None and cal.host.get(host_key(rt)):
        cells = ", ".join(f"B={b} {f:.1f} ms + {p:.2f} per expansion"
                          for b, (f, p) in sorted(cal.host[host_key(rt)].items()))
        print(f"  a draft step's host work beyond the head's passes: {cells}")
    for p in plans:
        what = f"{p['tree']} ({p['tree_size']} tokens)" if p["tree"] else "plain"
        print(f"  auto at B={p['batch_size']}: {what}, predicted {p['predicted_speedup']:.2f}x: {p['reason']}")
    return 0
