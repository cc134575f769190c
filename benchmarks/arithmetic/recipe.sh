#!/usr/bin/env bash
# The arithmetic task end to end on the embedded SmolLM2-135M-Instruct, on a CPU at one thread (about 35 min):
# make the problems, evaluate the starting policy on 300 held-out problems, GRPO with reward functions
# (trainer/configs/arithmetic/grpo.yaml), evaluate the trained adapter on the same problems, write the result.
#
#     bash benchmarks/arithmetic/recipe.sh [RUN_DIR]      # default runs/arithmetic
set -euo pipefail
RUN=${1:-runs/arithmetic}
PY=${PYTHON:-.venv/bin/python}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
CHECKS=benchmarks/arithmetic/rewards.py:correct,benchmarks/arithmetic/rewards.py:formatted
EVAL=(--data "$RUN/data/heldout.jsonl" --reward_fn "$CHECKS" --max_new_tokens 48 --model_name_or_path smollm2-135m
      --samples 300)  # every response kept: the report counts the answers given

$PY -m benchmarks.arithmetic.make_data --out "$RUN/data" --level one_digit --train 2000 --heldout 300
$PY -m trainer.evaluate exact_match --adapter none "${EVAL[@]}" --output_file "$RUN/before.json"
$PY -m trainer.grpo --config trainer/configs/arithmetic/grpo.yaml --dataset "$RUN/data/train.jsonl" \
    --output_dir "$RUN/grpo"
$PY -m trainer.evaluate exact_match --adapter "$RUN/grpo/adapter" "${EVAL[@]}" --output_file "$RUN/after.json"
$PY -m benchmarks.arithmetic.report --before "$RUN/before.json" --after "$RUN/after.json" \
    --run "$RUN/grpo" --out benchmarks/results/arithmetic-grpo-smollm2-135m-cpu
