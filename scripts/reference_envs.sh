#!/usr/bin/env bash
# Build (once) the side virtual environments in which other projects' loaders read this project's exports:
#   eagle   eagle-llm 1.2.1 (SafeAILab/EAGLE's release on PyPI) with transformers 4.53.3
#   medusa  medusa-llm 0.1 (FasterDecoding/Medusa's release on PyPI) with transformers 4.36.2
#   eagle-train  eagle-llm 1.2.1 with what its trainer (eagle/train/main.py) imports beside the model code:
#           accelerate and wandb (benchmarks/recipe_vs_reference.py; not used by the tests)
# Usage: bash scripts/reference_envs.sh NAME...   (NAME: eagle, medusa, eagle-train or all: the first two)
# Prints, for each NAME, "NAME PYTHON" where PYTHON is the environment's interpreter. An environment lives under
# ${MEDUSA_REFENV_DIR:-~/.cache/medusa/refenv}/NAME-HASH, HASH naming its pins and the Python that built it, and
# is reused while that directory holds a .complete marker; a build goes to a temporary directory renamed into
# place, so an interrupted one leaves nothing a later run would take for complete.
# The reference packages are installed without their declared dependencies: those (fschat, gradio, openai,
# anthropic, wandb, accelerate, sentencepiece, protobuf) serve their CLIs, web UI, training and evaluation
# scripts, which the model code (eagle.model.*, medusa.model.*) does not import. Only torch, transformers and
# what transformers itself needs are installed beside them.
set -euo pipefail
PY=${PYTHON:-python3}
ROOT=${MEDUSA_REFENV_DIR:-$HOME/.cache/medusa/refenv}
TORCH_PIN="torch==2.13.0"   # the release scripts/setup.sh installs

pins() {
  case "$1" in
    eagle)  echo "$TORCH_PIN transformers==4.53.3 tokenizers==0.21.4 safetensors==0.5.3 huggingface-hub==0.34.4 numpy==1.26.4 | eagle-llm==1.2.1" ;;
    eagle-train) echo "$TORCH_PIN transformers==4.53.3 tokenizers==0.21.4 safetensors==0.5.3 huggingface-hub==0.34.4 numpy==1.26.4 accelerate==1.16.0 wandb==0.31.0 tqdm | eagle-llm==1.2.1" ;;
    medusa) echo "$TORCH_PIN transformers==4.36.2 tokenizers==0.15.2 safetensors==0.4.5 huggingface-hub==0.20.3 numpy==1.26.4 | medusa-llm==0.1" ;;
    *) echo "reference_envs.sh: unknown environment '$1' (choose eagle, medusa, eagle-train or all)" >&2; return 2 ;;
  esac
}

build() {
  local name=$1 spec deps ref key dir tmp
  spec=$(pins "$name")
  deps=${spec%%|*}
  ref=${spec##*|}
  key=$( { echo "$spec"; "$PY" -c 'import sys; print(sys.version)'; } | sha256sum | cut -c1-12)
  dir="$ROOT/$name-$key"
  mkdir -p "$ROOT"
  exec 9>"$ROOT/.$name-$key.lock"
  flock 9
  if [ ! -f "$dir/.complete" ]; then
    rm -rf "$dir"
    tmp=$(mktemp -d "$ROOT/.$name-$key.XXXXXX")
    echo "reference_envs.sh: building $name in $dir ($spec)" >&2
    "$PY" -m venv "$tmp"
    # shellcheck disable=SC2086
    "$tmp/bin/python" -m pip install -q $deps >&2
    # shellcheck disable=SC2086
    "$tmp/bin/python" -m pip install -q --no-deps $ref >&2
    echo "$spec" > "$tmp/.pins"
    mv "$tmp" "$dir"
    touch "$dir/.complete"
  fi
  exec 9>&-
  echo "$name $dir/bin/python"
}

[ $# -ge 1 ] || { echo "usage: bash scripts/reference_envs.sh eagle|medusa|eagle-train|all ..." >&2; exit 2; }
for arg in "$@"; do
  if [ "$arg" = all ]; then build eagle; build medusa; else build "$arg"; fi
done
