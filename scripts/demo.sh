#!/usr/bin/env bash
# Demo: set up (idempotent), fetch and convert the embedded model once, then decode the same prompts with
# plain decoding and with the shipped heads under auto mode, side by side, and print both with their statistics.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export TOKENIZERS_PARALLELISM=false
exec .venv/bin/python -m medusa.demo "$@"
