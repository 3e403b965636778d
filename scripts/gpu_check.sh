#!/usr/bin/env bash
# The GPU check, one command: the cuda-marked tests, then the pass-cost curve and the predicted crossover
# of a ~1.1B Llama. Results go under $OUT (default benchmarks/results/): cuda_tests.log, cuda_tests.xml,
# gpu_curve.log, gpu_curve.json. Wall clock: at most 5 minutes of tests and 4 of curve (timeouts below).
#
#   bash scripts/gpu_check.sh                 # where `bash scripts/setup.sh` installed a CUDA build of torch
#   PYTHON=python3 bash scripts/gpu_check.sh  # or any Python whose torch sees the GPU (the repo goes on PYTHONPATH)
set -uo pipefail
cd "$(dirname "$0")/.."
if [ -n "${PYTHON:-}" ]; then
  PY=$PYTHON
elif [ -x .venv/bin/python ] && .venv/bin/python -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
  PY=.venv/bin/python
else
  PY=python3
fi
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false WANDB_MODE=disabled
if ! "$PY" -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
  echo "gpu_check: $PY has no torch that sees a CUDA device; nothing to check here" >&2
  exit 2
fi
"$PY" -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, '|',
torch.cuda.get_device_name(0), '| transformers', transformers.__version__)"

timeout 300 "$PY" -m pytest -m cuda -q -rs tests/test_cuda.py \
  --junitxml "$OUT/cuda_tests.xml" -o junit_family=xunit1 2>&1 | tee "$OUT/cuda_tests.log"
tests=$?
timeout 240 "$PY" benchmarks/gpu_curve.py --budget-s 150 --out "$OUT/gpu_curve.json" 2>&1 | tee "$OUT/gpu_curve.log"
curve=$?
echo "gpu_check: cuda tests exit $tests, curve exit $curve; results in $OUT"
[ "$tests" -eq 0 ] && [ "$curve" -eq 0 ]
