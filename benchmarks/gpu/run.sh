#!/usr/bin/env bash
# The GPU kit, on the GPU machine: run one or more parts and pack each into ONE archive under $OUT.
#
#   benchmarks/gpu/run.sh [--smoke] [--budget_s N] PART [PART ...]
#       PART: first | check | memory | grpo_recipe | speed | grpo_vs_trl | ladder | stages   (first: the headline figures)
#
# On the GPU machine (no index, no hub): installs the carried wheels (.whl/, from prepare.sh) into
# /tmp/site first. --smoke runs the same code paths on the CPU with the tiny preset (what CI runs).
# Each archive, $OUT/PART-MODEL-DEVICE.tar.gz, holds the part's folder with its manifest.json; unpack
# it here with `python -m benchmarks.gpu.collect ARCHIVE...`.
set -euo pipefail
cd "$(dirname "$0")/../.."
smoke=() budget=()
if [[ ${1:-} == --smoke ]]; then smoke=(--smoke true); shift; fi
if [[ ${1:-} == --budget_s ]]; then budget=(--budget_s "${2:?--budget_s needs seconds}"); shift 2; fi
[[ $# -ge 1 ]] || { echo "usage: benchmarks/gpu/run.sh [--smoke] [--budget_s N] first|check|memory|grpo_recipe|speed|grpo_vs_trl|ladder|stages ..." >&2; exit 2; }
OUT=${OUT:-$PWD/.gpu-out}
mkdir -p "$OUT"
# The project's venv where there is one (development machines, CI); the GPU machine's own python3 there.
PY=${PYTHON:-python3}
[[ -z ${PYTHON:-} && -x .venv/bin/python ]] && PY=.venv/bin/python
if [[ ${#smoke[@]} -eq 0 && -d .whl ]]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
  # the project's pins of what the image has in other versions (prepare.sh: benchmarks/gpu/wheels.py), ahead of
  # the image's own; where they do not import with the image's other libraries, the image's own run instead
  if ls .whl/pinned/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/pinned .whl/pinned/*.whl
    if PYTHONPATH=/tmp/pinned:$PYTHONPATH "$PY" -c "import transformers, peft, tokenizers; from transformers import AutoModelForCausalLM" 2>/tmp/pinned.err; then
      export PYTHONPATH=/tmp/pinned:$PYTHONPATH
    else
      echo "the pinned wheels in .whl/pinned do not import here ($(tail -1 /tmp/pinned.err)); the image's own versions run" >&2
    fi
  fi
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
# prepare.sh wrote the revision the tree was taken at; the GPU machine's .git, where one travels, can be
# an older snapshot of the checkout, so there the prepared revision wins (a smoke run here reads git).
if [[ ${#smoke[@]} -eq 0 && -f .data/git-revision ]]; then
  export RLHF_GIT_REVISION=$(cat .data/git-revision)
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/torch_extensions}
work=.gpu-work  # inside the project: the parts' commands and files name it relative to the root
rm -rf "$work" && mkdir -p "$work"
status=0
for part in "$@"; do
  "$PY" -m benchmarks.gpu.parts "$part" --out "$work/$part" ${smoke[@]+"${smoke[@]}"} ${budget[@]+"${budget[@]}"} || status=$?
  [[ -d $work/$part ]] || continue  # the part never started (a typo in its name: parts.py said so)
  name=$("$PY" -c "import json,sys; m=json.load(open(sys.argv[1])); print('-'.join([m['part'], m['model'], 'smoke' if m['smoke'] else m['device_slug']]))" "$work/$part/manifest.json" 2>/dev/null || echo "$part-failed")
  # weights and checkpoints stay behind: the 7B adapters alone are 160 MB each
  tar -czf "$OUT/$name.tar.gz" --exclude=adapter --exclude='checkpoint-*' --exclude='previous-*' \
      --exclude='*.safetensors' --exclude='*.pt' --exclude=tensorboard -C "$work" "$part"
  echo "packed $OUT/$name.tar.gz ($(du -h "$OUT/$name.tar.gz" | cut -f1))"
done
rm -rf "$work"
exit $status
