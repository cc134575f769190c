"""benchmarks/stages_vs_trl: both sides train on the planned rows, and TRL's adapters are scored as TRL computes them."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # benchmarks/ sits beside the installed packages, not inside them
    sys.path.insert(0, str(ROOT))

from benchmarks.stages_vs_trl import StageWorkload, main  # noqa: E402

# 64 rows of each split: what 3 steps of 4 rows need once filtered by length, not the whole split tokenized
TINY = ["--model_name_or_path", "tiny-llama", "--lora_r", "4", "--lora_alpha", "8", "--max_length", "96",
        "--min_prompt_tokens", "4", "--max_steps", "3", "--micro_batch_size", "2", "--gradient_accumulation_steps", "2",
        "--eval_size", "16", "--eval_batch_size", "4", "--warmup_steps", "1", "--learning_rate", "0.01",
        "--sft_size", "64", "--reward_size", "64"]


def _randomize_lora_(model) -> None:
    """LoRA B starts at zero (the adapter is the base); random B makes the adapters matter."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.1)


@pytest.mark.parametrize("stage", ["reward", "sft"])
def test_trl_adapters_converted_to_ours_score_exactly_as_trl_computes_them(stage, tmp_path):
    """Reward: TRL's LoRA + `score`, read at EOS (its pad is set apart from EOS), equal our reward adapter + head
    after `to_our_adapter`; SFT / DPO: TRL's causal-LM adapter gives our model the same log-probs."""
    from peft import LoraConfig, get_peft_model

    from benchmarks.trl_stages import REWARD_PAD, load_model, to_our_adapter
    from benchmarks.workload import lora_targets
    from foundation.stages import POLICY, REWARD
    from trainer.engine.setup import base_model_args
    from trainer.losses import last_token_values
    from trainer.model.loading import load_tokenizer
    from trainer.model.shared_base import AdapterSpec, build_shared_model

    w = StageWorkload.parse(TINY + ["--stage", stage])
    tokenizer = load_tokenizer("tiny-llama")
    device = torch.device("cpu")
    model = load_model(w, len(tokenizer), device)
    peft = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=lora_targets(w.model.lora_target_modules),
                                            task_type="SEQ_CLS" if stage == "reward" else "CAUSAL_LM"))
    _randomize_lora_(peft)
    peft.save_pretrained(str(tmp_path / "trl-adapter"))
    to_our_adapter(w, tmp_path / "trl-adapter", tmp_path / "adapter")

    pad = tokenizer.convert_tokens_to_ids(REWARD_PAD)
    rows = [[5, 17, 300, 41, 9, tokenizer.eos_token_id], [8, 12, 77, tokenizer.eos_token_id]]
    ids = torch.full((2, 6), pad)
    mask = torch.zeros(2, 6, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)], mask[i, : len(row)] = torch.tensor(row), 1
    role = REWARD if stage == "reward" else POLICY
    ours = build_shared_model(base_model_args(tmp_path / "adapter"),
                              [AdapterSpec(role, init_from=str(tmp_path / "adapter"), head=stage == "reward")],
                              vocab_size=len(tokenizer), device=device).eval()
    peft.eval()
    with torch.no_grad():
        if stage == "reward":
            peft.config.pad_token_id = pad  # what RewardTrainer sets from RewardConfig.pad_token
            model.config.pad_token_id = pad
            trl_scores = peft(input_ids=ids, attention_mask=mask).logits.squeeze(-1)
            our_scores = last_token_values(ours(ids, mask, adapter=REWARD, output="scores"), mask)
            torch.testing.assert_close(our_scores, trl_scores, rtol=1e-5, atol=1e-5)
        else:
            logits = peft(input_ids=ids, attention_mask=mask).logits[:, :-1]
            labels = ids.masked_fill(mask == 0, -100)
            trl_logp = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, 1:, None].clamp(min=0)).squeeze(-1)
            trl_logp = trl_logp * (labels[:, 1:] != -100)
            our_logp = ours(ids, mask, adapter=POLICY, output="logprobs", labels=labels)
            torch.testing.assert_close(our_logp, trl_logp, rtol=1e-4, atol=1e-4)
    assert json.loads((tmp_path / "config.json").read_text())["data"]["eval_size"] == 16  # trainer.evaluate's split


@pytest.fixture
def sides_in_this_process(monkeypatch):
    """Each side's `python -m benchmarks.stage_side` runs in this process: its own process start is what the GPU
    kit's smoke run proves (tests/test_gpu_kit.py), the sides' work is what these tests check."""
    import subprocess

    from benchmarks import stage_side

    real = subprocess.run

    def run(command, **kwargs):
        if command[1:3] != ["-m", "benchmarks.stage_side"]:
            return real(command, **kwargs)
        stage_side.main(command[3:])
        return subprocess.CompletedProcess(command, 0)

    monkeypatch.chdir(ROOT)  # the side's own cwd
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    monkeypatch.setattr(subprocess, "run", run)


@pytest.mark.parametrize("stage", ["sft", "reward"])
def test_both_sides_train_on_the_planned_rows_and_are_scored_by_the_same_evaluation(stage, tmp_path,
                                                                                   sides_in_this_process):
    """SFT and reward with the GPU kit's flags (NF4 base, 8-bit AdamW). DPO: the kit's smoke run is CI's one run
    of it, with these checks and the tensor walk (tests/test_gpu_kit.py::test_stages_compare_dpo_with_trl_on_the_
    planned_rows)."""
    out = tmp_path / "out"
    report = main([*TINY, "--stage", stage, "--out_dir", str(out), "--quantization", "nf4",
                   "--optimizer", "adamw_8bit"])
    ours, trl = report["sides"]["ours"], report["sides"]["trl"]
    assert "memory" not in ours and "memory" not in trl  # no tensor walk unless --profile_memory true
    for side in (ours, trl):
        assert side["status"] == "ok", side.get("error")
        assert side["rows_as_planned"] is True  # every micro-batch held the planned rows, in order
        assert [s["step"] for s in side["steps"]] == [1, 2, 3]
        summary = side["summary"]
        assert summary["measured_steps"] == 2 and summary["step_s"] > 0 and summary["tokens_per_s"] > 0
        assert summary["peak_rss_bytes"] > 0
    if stage == "reward":  # TRL trained its score head (a PEFT modules_to_save copy), converted into ours
        from safetensors.torch import load_file

        from benchmarks.workload import head_weights

        head = load_file(str(out / "trl" / "adapter" / "head.safetensors"))["linear.weight"]
        assert not torch.allclose(head, head_weights(64, 0)["reward"])
    key = {"sft": "rows", "reward": "pairs"}[stage]
    assert ours["evaluation"][key] == trl["evaluation"][key] > 0  # the same held-out rows for both
    interval = "perplexity_ci95" if stage == "sft" else "accuracy_ci95"
    for side in (ours, trl):
        metric = side["evaluation"]["perplexity" if stage == "sft" else "accuracy"]
        low, high = side["evaluation"][interval]
        assert low <= metric <= high and low < high
    tokens = report["rows"]["tokens_per_step"]
    assert len(ours["computed_tokens_per_step"]) == len(trl["computed_tokens_per_step"]) == 3
    for side in (ours, trl) if stage == "sft" else (trl,):  # rows x the longest row: at least the real tokens
        assert all(c >= t for c, t in zip(side["computed_tokens_per_step"], tokens))
    if stage == "reward":  # one row per pair: the prompt computed once
        assert sum(ours["computed_tokens_per_step"]) < sum(trl["computed_tokens_per_step"])
    if stage == "sft":  # scored again by today's evaluation: the same figures, and the re-scoring recorded
        saved = json.loads((out / "stages_vs_trl.json").read_text())
        saved["sides"]["trl"]["computed_tokens_per_step"] = None  # as in a result written before they were counted
        saved["settings"]["bench"]["table"] = False  # a flag removed since: the old result still re-scores
        (out / "stages_vs_trl.json").write_text(json.dumps(saved))
        again = main(["--rescore", str(out)])
        assert again["sides"]["trl"]["computed_tokens_per_step"] == trl["computed_tokens_per_step"]
        assert again["sides"]["ours"]["evaluation"] == ours["evaluation"]
        assert again["rescored"]["command"] == (f"python -m benchmarks.stages_vs_trl --rescore "
                                                f"{os.path.relpath(out, ROOT)}")  # no machine's absolute path
        assert "re-scored on" in (out / "stages_vs_trl.md").read_text()
        assert again["sides"]["trl"]["steps"] == trl["steps"]  # the training figures are left as measured
    assert report["rows"]["train_rows"] == 3 * 4 and len(report["rows"]["tokens_per_step"]) == 3
    assert report["ratios"]["step_time_speedup"] > 0
    from foundation.provenance import shown_command

    assert f"- command: `{shown_command(report)}`" in (out / "stages_vs_trl.md").read_text()  # settings first
    assert shown_command(report).endswith(report["command"]) and report["command"].startswith(
        "python -m benchmarks.stages_vs_trl ")
    assert json.loads((out / "stages_vs_trl.json").read_text())["stage"] == stage


def test_the_rows_are_our_harness_order_and_too_few_rows_fail_before_any_side_runs(tmp_path):
    from benchmarks.stages_vs_trl import expected_trace, step_tokens, training_rows
    from foundation.cli import UsageError
    from trainer.model.loading import load_tokenizer

    w = StageWorkload.parse(TINY + ["--stage", "dpo"])
    tokenizer = load_tokenizer("tiny-llama")
    rows = training_rows(w, tokenizer)
    assert len(rows) == 12 and len({tuple(r.prompt_ids + r.chosen_ids) for r in rows}) == 12
    trace = expected_trace(w, rows)
    assert len(trace) == 6 and all(len(batch) == 4 for batch in trace)  # 2 pairs: 2 chosen rows over 2 rejected
    assert step_tokens(w, rows)[0] == sum(2 * len(r.prompt_ids) + len(r.chosen_ids) + len(r.rejected_ids)
                                          for r in rows[:4])
    with pytest.raises(UsageError, match="steps of 4 rows need"):
        training_rows(replace(w, train=replace(w.train, max_steps=100_000)), tokenizer)
