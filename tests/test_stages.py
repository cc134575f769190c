"""Reward stage scoring, the entry scripts under `accelerate launch`, and the evaluation CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import in_process

ROOT = Path(__file__).resolve().parent.parent
TINY_SFT = ROOT / "tests" / "configs" / "tiny_sft.yaml"


@pytest.fixture(scope="module")
def pair_batch(shared_data, smol_tokenizer):
    from foundation.settings import DataArguments
    from trainer.data.collators import PairCollator
    from trainer.data.hh_rlhf import load_pairs
    from trainer.data.tokenization import tokenize_pairs

    args = DataArguments(dataset=str(shared_data / "helpful-base"), max_length=96, min_prompt_tokens=4)
    pairs, _ = load_pairs(args)
    examples, _ = tokenize_pairs(pairs[:40], smol_tokenizer, args)
    return examples[:3], PairCollator(smol_tokenizer.pad_token_id)


def tiny_reward_model(vocab):
    from foundation.settings import ModelArguments
    from trainer.model.shared_base import AdapterSpec, build_shared_model

    args = ModelArguments(model_name_or_path="tiny-llama", lora_r=4, lora_alpha=8, gradient_checkpointing=False)
    model = build_shared_model(args, [AdapterSpec("reward", trainable=True, head=True)], vocab_size=vocab,
                               device=torch.device("cpu"))
    with torch.no_grad():  # non-zero LoRA B so the adapter matters
        for p in model.trainable_parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


def test_reward_stage_scores_chosen_and_rejected_in_one_forward_pass(pair_batch, smol_tokenizer):
    from trainer.losses import pairwise_ranking_losses, ranking_stats
    from trainer.reward import pair_rewards

    examples, collate = pair_batch
    model = tiny_reward_model(len(smol_tokenizer))
    calls = []
    handle = model.register_forward_hook(lambda m, args, kwargs, out: calls.append(args[0].shape) or None,
                                         with_kwargs=True)
    batch = collate(examples)
    rc, rr = pair_rewards(model, batch)  # what the reward stage's step body scores
    loss, accuracy = pairwise_ranking_losses(rc, rr), ranking_stats(rc, rr)["accuracy"]
    handle.remove()
    assert calls == [torch.Size([6, batch["input_ids"].shape[1]])]  # one pass over 2B rows
    # Same rewards as scoring each side on its own (row i of the batch pairs with row i + B).
    chosen, rejected = [], []
    for ex in examples:
        for ids, sink in ((ex.prompt_ids + ex.chosen_ids, chosen), (ex.prompt_ids + ex.rejected_ids, rejected)):
            t = torch.tensor([ids])
            sink.append(model(t, torch.ones_like(t), adapter="reward", output="scores")[0, -1])
    expected = pairwise_ranking_losses(torch.stack(chosen), torch.stack(rejected))
    torch.testing.assert_close(loss, expected, rtol=1e-4, atol=1e-5)
    expected_acc = (torch.stack(chosen) > torch.stack(rejected)).float().mean()
    assert float(accuracy) == pytest.approx(float(expected_acc))


def test_pair_batches_count_one_unit_per_pair_in_either_layout(pair_batch):
    """The reward and DPO losses are means over pairs: a batch of 3 pairs is 3 units, as 6 rows or as 3."""
    from trainer.data.collators import SharedPromptPairCollator, pairs_in

    examples, collate = pair_batch
    stacked, shared = collate(examples), SharedPromptPairCollator(collate.pad_token_id)(examples)
    assert stacked["input_ids"].shape[0] == 6 and shared["input_ids"].shape[0] == 3
    assert pairs_in(stacked) == pairs_in(shared) == 3


def run(cmd, **kw):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900, **kw)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def evaluate_cli(capsys, *argv: str) -> dict:
    """`python -m trainer.evaluate ARGV` in this process: the one JSON line it prints last."""
    capsys.readouterr()
    in_process("trainer.evaluate", list(argv))
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def launched_runs(tmp_path_factory):
    """SFT through `accelerate launch` on the CPU config, then reward warm-started from its adapter (in this
    process: the launch is the SFT run's)."""
    root = tmp_path_factory.mktemp("launch")
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
              str(ROOT / "accelerate_configs" / "cpu.yaml")]
    short = ["--config", str(TINY_SFT), "--max_steps", "2", "--save_every", "0", "--eval_every", "0"]
    run([*launch, "trainer/sft.py", *short, "--output_dir", str(root / "sft"), "--profile_memory", "true"])
    in_process("trainer.reward", [*short, "--output_dir", str(root / "reward"), "--sft_adapter",
                                  str(root / "sft" / "adapter")])
    return root


def test_accelerate_launch_runs_sft_and_the_reward_stage_warm_starts_from_its_peft_adapter(launched_runs):
    for stage, role in (("sft", "policy"), ("reward", "reward")):
        results = json.loads((launched_runs / stage / "results.json").read_text())
        assert results["stage"] == stage
        adapter = Path(results["adapter"])
        assert (adapter / "adapter_config.json").is_file() and (adapter / "base_model.json").is_file()
        assert results["eval_before"]["step"] == 0 and results["eval_after"]["step"] == 2
    assert (launched_runs / "reward" / "adapter" / "head.safetensors").is_file()
    sft_cfg = json.loads((launched_runs / "sft" / "adapter" / "adapter_config.json").read_text())
    assert sft_cfg["r"] == 4
    reward_cfg = json.loads((launched_runs / "reward" / "config.json").read_text())
    assert reward_cfg["stage"]["sft_adapter"] == str(launched_runs / "sft" / "adapter")


def test_evaluate_cli_prints_one_json_line_for_any_hh_rlhf_file(launched_runs, shared_data, capsys):
    data = shared_data / "harmless-base" / "test.jsonl.gz"
    line = evaluate_cli(capsys, "reward", "--adapter", str(launched_runs / "reward" / "adapter"), "--data", str(data),
                        "--limit", "24")
    assert line["task"] == "reward" and line["pairs"] == 24 and 0.0 <= line["accuracy"] <= 1.0
    low, high = line["accuracy_ci95"]
    assert low < line["accuracy"] < high


@pytest.mark.parametrize("stage,key", [("sft", "perplexity"), ("reward", "accuracy")])
def test_evaluate_on_the_runs_eval_split_reproduces_the_stages_final_evaluation(launched_runs, stage, key, capsys):
    """The CLI and the stage share one evaluation: on the same rows they give the same figure."""
    line = evaluate_cli(capsys, stage, "--adapter", str(launched_runs / stage / "adapter"), "--split", "eval")
    after = json.loads((launched_runs / stage / "results.json").read_text())["eval_after"]
    assert line[key] == pytest.approx(after[f"eval/{key}"], rel=1e-5)
    assert line["pairs" if stage == "reward" else "rows"] > 0


def test_a_stage_with_profile_memory_writes_the_memory_report(launched_runs, smol_tokenizer):
    from foundation.settings import ModelArguments
    from trainer.model.shared_base import AdapterSpec, build_shared_model

    data = json.loads((launched_runs / "sft" / "memory.json").read_text())
    phases = {p["phase"]: p for p in data["phases"]}
    assert set(phases) == {"evaluate", "forward_backward", "optimizer_step"}
    fb = phases["forward_backward"]["components"]
    # the run's one adapter (tiny_sft.yaml: LoRA r 4), fp32: its weights, their gradients, AdamW's two
    # moments of each and a step count per tensor
    sft = build_shared_model(ModelArguments(model_name_or_path="tiny-llama", lora_r=4, lora_alpha=8),
                             [AdapterSpec("policy", trainable=True)], vocab_size=len(smol_tokenizer))
    tensors = sft.trainable_parameters()
    weights = sum(p.numel() for p in tensors)
    assert fb["adapter/policy"] == fb["gradients"] == 4 * weights
    assert fb["optimizer_states"] == 8 * weights + 4 * len(tensors)
    assert phases["forward_backward"]["saved_for_backward"] > 0  # metered on the first step
    assert data["git_revision"] and data["command"].startswith(("trainer/sft.py", str(ROOT)))
    assert fb["activations"] > 0 and "activations" not in data["needs_gpu"]  # the CPU allocator's events
    assert "cuda_context" in data["needs_gpu"]  # said, not faked, on a CPU machine
    assert data["cuda_context_at_start"] is None  # what a CUDA run's estimate had; none measured here
    assert (launched_runs / "sft" / "memory.md").is_file()
    from PIL import Image

    with Image.open(launched_runs / "sft" / "memory.png") as image:
        assert image.size[0] > 400


def synthetic_preferences(shared_data: Path, out: Path, rows: int = 240) -> Path:
    """Real hh-rlhf prompts, each followed by the same helpful (chosen) and curt (rejected) answer: a
    preference even the tiny random model can learn and carry over to prompts it never saw."""
    import gzip

    with gzip.open(shared_data / "helpful-base" / "test.jsonl.gz", "rt") as f:
        prompts = [json.loads(line)["chosen"] for line in f][:rows]
    prompts = [p[: p.rfind("\n\nAssistant:")] for p in prompts]
    with open(out, "w") as f:
        for prompt in prompts:
            f.write(json.dumps({"chosen": prompt + "\n\nAssistant: Sure, here is a careful and kind answer.",
                                "rejected": prompt + "\n\nAssistant: No."}) + "\n")
    return out


def held_out(run_dir: Path, key: str) -> tuple[float, float]:
    results = json.loads((run_dir / "results.json").read_text())
    return results["eval_before"][key], results["eval_after"][key]


@pytest.mark.parametrize("stage", ["sft", "reward", "dpo"])
def test_training_moves_the_held_out_metric_the_right_way(stage, shared_data, tmp_path):
    """Long enough to learn: perplexity on held-out real dialogues falls; reward and DPO held-out pair
    accuracy rises from chance (or 0, DPO's ties) to nearly all pairs on prompts never trained on."""
    data = str(shared_data) if stage == "sft" else str(synthetic_preferences(shared_data, tmp_path / "pairs.jsonl"))
    out = tmp_path / stage
    steps = "24" if stage == "sft" else "8"  # perplexity falls slowly; pair accuracy is learnt in a few steps
    in_process(f"trainer.{stage}", ["--config", str(TINY_SFT), "--output_dir", str(out), "--dataset", data,
                                     "--max_steps", steps, "--eval_every", "0", "--save_every", "0", "--eval_batches",
                                     "0", "--eval_size", "32", "--learning_rate", "0.01" if stage == "sft" else "0.005",
                                     "--warmup_steps", "2", "--lora_dropout", "0.0"])
    if stage == "sft":
        before, after = held_out(out, "eval/loss")  # nats per completion token, perplexity's log
        assert after < before - 0.1, (before, after)  # measured: 10.81 -> 10.67
    else:
        key = "eval/accuracy" if stage == "reward" else "eval/rewards/accuracies"
        before, after = held_out(out, key)
        assert before <= 0.75 and after >= 0.9, (before, after)  # measured: 0.06 (DPO: 0) -> 1.0
        assert json.loads((out / "results.json").read_text())["eval_after"]["eval/pairs"] >= 30
