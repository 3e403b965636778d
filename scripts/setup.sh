#!/usr/bin/env bash
# Create .venv and install the project with everything its tests, training, evaluation and server use.
# torch is pinned to the release whose CPU wheel is installed first, so no CUDA build is pulled in.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[train,eval,serve,test]"
