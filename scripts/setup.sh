#!/usr/bin/env bash
# Create .venv and install the project with everything its tests, training, evaluation, server and docs use.
# The distribution (medusa-decoding) takes any torch >= 2.6; here the CPU wheel of the release the project is
# tested with is installed first, so no CUDA build is pulled in.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==2.13.0"
# An install from before the distribution was renamed (it was called medusa) would own the same package.
if .venv/bin/python -m pip show -q medusa >/dev/null 2>&1; then
  .venv/bin/python -m pip uninstall -q -y medusa
fi
.venv/bin/python -m pip install -q -e ".[train,eval,serve,test,docs]"
