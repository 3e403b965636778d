"""Records which training examples each process trained on, for the distributed training tests.

`install(out_dir)` wraps the point where a micro-batch reaches the heads (`HeadsOnly.loss`) and writes
`out_dir/rank-<RANK>.json`: for every optimizer step, the ids of the table positions (indices into the
table's trainable positions, the items `Batches` orders) whose hidden states this process fed to its heads.
The ids are recovered from the hidden-state rows themselves, so whatever slice of the global batch a rank
ends up with, from whichever place in the code, is what gets recorded.

As a script, under a launcher: `rank_data_probe.py OUT_DIR <medusa CLI arguments>` installs the probe and
runs the CLI.
"""

from __future__ import annotations

import json
import os
import sys
from collections import defaultdict
from pathlib import Path


def install(out_dir: str | Path, setattr=setattr) -> None:
    """Patch the training code (pass `monkeypatch.setattr` to undo it after a test)."""
    from medusa.train.batches import TableBatches
    from medusa.train.strategy import HeadsOnly

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"rank-{os.environ.get('RANK', '0')}.json"
    state: dict = {"ids": None, "steps": defaultdict(list)}
    init, loss = TableBatches.__init__, HeadsOnly.loss

    def table_init(self, cfg, d, table):
        init(self, cfg, d, table)
        rows = table.hidden[self.positions]
        ids = {row.float().numpy().tobytes(): i for i, row in enumerate(rows)}
        if len(ids) != len(rows):
            raise AssertionError("rank_data_probe: two trainable positions share a hidden state; "
                                 "their rows cannot tell them apart")
        state["ids"] = ids
        state["meta"] = {"items": self.items, "per_epoch": self.per_epoch,
                         "unit": cfg.batch_size * cfg.grad_accum, "world": d.world}

    def recording_loss(self, model, micro, step):
        ids = state["ids"]
        state["steps"][step] += [ids[row.detach().float().cpu().numpy().tobytes()] for row in micro.hidden]
        path.write_text(json.dumps({**state["meta"], "steps": {str(s): v for s, v in state["steps"].items()}}))
        return loss(self, model, micro, step)

    setattr(TableBatches, "__init__", table_init)
    setattr(HeadsOnly, "loss", recording_loss)


def read(out_dir: str | Path, rank: int = 0) -> dict:
    """What rank `rank` recorded: the run's sizes and `steps` (step -> ids trained on, in order)."""
    data = json.loads((Path(out_dir) / f"rank-{rank}.json").read_text())
    data["steps"] = {int(s): v for s, v in data["steps"].items()}
    return data


if __name__ == "__main__":
    install(sys.argv[1])
    from medusa.cli import main

    sys.exit(main(sys.argv[2:]))
