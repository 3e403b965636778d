"""Auto mode without heads: retrieval alone (`medusa.decoding.proposers.retrieval`), for any model.

Retrieval's acceptance depends on the text (high where the answer repeats the prompt, low in free
writing), so nothing predicts it up front. The tree is the largest of SIZES whose pass costs at most
MAX_RATIO one-token passes on this machine's calibrated curve at that batch size (none: plain decoding),
and the acceptance gate (`medusa.runtime.gate`) judges it step by step, pausing it where it measures as a
loss, as for every proposer in auto mode.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from medusa.decoding.proposers.retrieval import RetrievalProposer

if TYPE_CHECKING:
    from medusa.runtime import Runtime
    from medusa.runtime.auto import AutoSpeculation

SIZES = (16, 8, 4)
MAX_RATIO = 1.25


def retrieval_auto(rt: "Runtime", batch_size: int, progress: bool = True) -> "AutoSpeculation":
    from medusa.runtime.auto import AutoSpeculation, Plan
    from medusa.runtime.calibrate import load_or_measure
    from medusa.runtime.gate import bucket

    cal = load_or_measure(rt, [1 << i for i in range(bucket(batch_size).bit_length())], progress=progress)
    proposers = {n: RetrievalProposer(n, rt.retriever()) for n in SIZES}

    @functools.lru_cache(maxsize=None)
    def plans(rows: int) -> Plan:
        for n in SIZES:
            ratio = cal.ratio(rows, n + 1)
            if ratio <= MAX_RATIO:
                return Plan(rows, proposers[n].tree, 0.0, 0.0, f"no heads: drafts from the text itself, a "
                            f"{n + 1}-token pass costs {ratio:.2f} plain steps; judged by measurement")
        return Plan(rows, None, 1.0, 1.0, f"no heads, and a {SIZES[-1] + 1}-token pass costs "
                                          f"{cal.ratio(rows, SIZES[-1] + 1):.2f} plain steps (> {MAX_RATIO})")

    by_name = {p.tree.name: p for p in proposers.values()}
    span = max(p.span for p in proposers.values())
    return AutoSpeculation(plans, lambda tree: by_name[tree.name], span, predicted=False, plain_scale=cal.plain_scale)
