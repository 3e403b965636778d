"""Run SafeAILab's own EAGLE-1 trainer (`eagle/train/main.py` of eagle-llm 1.2.1, as installed from PyPI) for a
given number of its epochs, then stop. Runs inside the side environment `scripts/reference_envs.sh eagle-train`
builds; `benchmarks/recipe_vs_reference.py` calls it. It imports nothing from this repository.

    python eagle_reference_trainer.py EPOCHS [WARMUP] -- --basepath B --configpath C --tmpdir DATA --cpdir OUT \
        --bs 8 --lr 3e-5

Their file is run unmodified. Three things around it, a fourth on request:
- device placement: on a machine without CUDA, `Tensor.cuda()` (which their epoch-end metric code calls) returns
  the tensor where it is;
- their train/test split takes the first 95% of `os.walk`'s file order, which is the file system's; the walk is
  sorted here, so the file names decide the split (recipe_vs_reference.py names them so that the training files
  come first);
- they train for 20 epochs and save `cpdir/state_<epoch>` after most of them: the process ends once the state of
  epoch EPOCHS - 1 is saved;
- WARMUP, when given, replaces the length of their linear warm-up (`num_warmup_steps`, 2,000 in their
  `train_config`) in the one scheduler they build, `transformers.get_linear_schedule_with_warmup`; the rest of
  their schedule (decay to zero at their `total_steps`, 800,000) stays. A run of a few hundred steps is otherwise
  spent entirely inside their warm-up.
"""

from __future__ import annotations

import os
import runpy
import sys


def main() -> None:
    usage = "usage: eagle_reference_trainer.py EPOCHS [WARMUP] -- ARGS-OF-eagle.train.main"
    if "--" not in sys.argv[2:4]:
        raise SystemExit(usage)
    sep = sys.argv.index("--")
    epochs = int(sys.argv[1])
    warmup = int(sys.argv[2]) if sep == 3 else None
    import torch
    import transformers

    if warmup is not None:
        linear = transformers.get_linear_schedule_with_warmup

        def with_warmup(optimizer, num_warmup_steps, num_training_steps, *args, **kwargs):
            print(f"eagle_reference_trainer: warm-up {num_warmup_steps} -> {warmup} steps", flush=True)
            return linear(optimizer, warmup, num_training_steps, *args, **kwargs)

        transformers.get_linear_schedule_with_warmup = with_warmup

    if not torch.cuda.is_available():
        torch.Tensor.cuda = lambda self, *args, **kwargs: self

    walk = os.walk

    def sorted_walk(top, *args, **kwargs):
        for root, dirs, files in walk(top, *args, **kwargs):
            dirs.sort()
            yield root, dirs, sorted(files)

    os.walk = sorted_walk

    from accelerate import Accelerator

    save_state = Accelerator.save_state

    def save_then_stop(self, output_dir=None, *args, **kwargs):
        out = save_state(self, output_dir, *args, **kwargs)
        if output_dir is not None and os.path.basename(str(output_dir)) == f"state_{epochs - 1}":
            print(f"eagle_reference_trainer: {output_dir} saved after {epochs} epoch(s); stopping", flush=True)
            raise SystemExit(0)
        return out

    Accelerator.save_state = save_then_stop
    sys.argv = ["eagle.train.main", *sys.argv[sep + 1:]]
    runpy.run_module("eagle.train.main", run_name="__main__")
    raise SystemExit(f"eagle.train.main ended before saving state_{epochs - 1}")


if __name__ == "__main__":
    main()
