#!/usr/bin/env bash
# The test command: set up (idempotent), then run the whole suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export TOKENIZERS_PARALLELISM=false WANDB_MODE=disabled
exec .venv/bin/python -m pytest -q "$@"
