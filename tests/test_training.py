"""The shared loop: kill-and-resume equals an uninterrupted run, atomic checkpoints, NaN guard."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from trainer.checkpoint import complete_checkpoints, latest_checkpoint

ROOT = Path(__file__).resolve().parent.parent
TINY_SFT = ROOT / "tests" / "configs" / "tiny_sft.yaml"
DETERMINISTIC_KEYS = ("train/loss", "train/grad_norm", "train/lr", "eval/loss", "eval/perplexity")


def run_sft(output_dir: Path, *extra: str, env_extra: dict | None = None, wait: bool = True):
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env_extra or {})}
    cmd = [sys.executable, str(ROOT / "trainer" / "sft.py"), "--config", str(TINY_SFT), "--output_dir", str(output_dir), *extra]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if not wait:
        return proc
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-3000:]
    return out


def metric_rows(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: r[k] for k in ("step", *DETERMINISTIC_KEYS) if k in r} for r in rows]


def adapter_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "adapter" / "adapter_model.safetensors"))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("straight") / "run"
    run_sft(out)
    return out


def wait_for(predicate, proc, timeout=300):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        if proc.poll() is not None:
            raise AssertionError(f"run ended before the kill point: {proc.stdout.read()[-3000:]}")
        time.sleep(0.02)
    raise AssertionError("timed out waiting for the kill point")


def test_sigkilled_run_resumes_to_the_same_parameters_and_metrics(uninterrupted, tmp_path):
    out = tmp_path / "killed"
    proc = run_sft(out, wait=False)
    wait_for(lambda: (out / "checkpoint-0000004").is_dir(), proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (out / "adapter").exists(), "the run finished before it was killed"
    assert latest_checkpoint(out).name in ("checkpoint-0000004", "checkpoint-0000006")
    log = run_sft(out)
    assert "resumed from" in log
    assert metric_rows(out) == metric_rows(uninterrupted)
    a, b = adapter_weights(uninterrupted), adapter_weights(out)
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


KILL_IN_SAVE = """
import os, signal, sys
import trainer.checkpoint as ck
real = ck._fsync_tree
def dying_fsync(root):
    if root.name.startswith("checkpoint-0000004"):
        os.kill(os.getpid(), signal.SIGKILL)  # every file written, nothing renamed yet
    real(root)
ck._fsync_tree = dying_fsync
sys.argv = sys.argv[1:]
from trainer.sft import main
main(sys.argv[1:])
"""


def test_kill_during_a_checkpoint_write_leaves_the_previous_one_readable(uninterrupted, tmp_path):
    out = tmp_path / "killed-in-save"
    script = tmp_path / "kill_in_save.py"
    script.write_text(KILL_IN_SAVE)
    proc = subprocess.run([sys.executable, str(script), "sft", "--config", str(TINY_SFT), "--output_dir", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == -signal.SIGKILL, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert (out / "checkpoint-0000004.tmp").is_dir()  # the half-published save is there...
    assert [p.name for p in complete_checkpoints(out)] == ["checkpoint-0000002"]  # ...and ignored
    log = run_sft(out)
    assert "resumed from" in log and "checkpoint-0000002" in log
    assert not (out / "checkpoint-0000004.tmp").exists()
    assert metric_rows(out) == metric_rows(uninterrupted)
    for key, value in adapter_weights(uninterrupted).items():
        assert torch.equal(value, adapter_weights(out)[key]), key


# ---- in-process loop tests on the tiny model ----------------------------------------------------

@pytest.fixture(scope="module")
def tiny_sft_data(shared_data, smol_tokenizer):
    from trainer.config import DataArguments
    from trainer.data import load_splits
    from trainer.tokenization import tokenize_sft

    args = DataArguments(dataset=str(shared_data / "harmless-base"), max_length=96, min_prompt_tokens=4,
                         eval_size=8, sft_size=48, reward_size=0, ppo_size=0)
    splits, _ = load_splits(args)
    train, _ = tokenize_sft(splits.sft, smol_tokenizer, args)
    held_out, _ = tokenize_sft(splits.eval, smol_tokenizer, args)
    return train, held_out


def tiny_policy(vocab: int, dropout: float = 0.0):
    from trainer.config import ModelArguments
    from trainer.shared_base import AdapterSpec, build_shared_model

    args = ModelArguments(model_name_or_path="tiny-llama", lora_r=4, lora_alpha=8, lora_dropout=dropout,
                          gradient_checkpointing=False)
    return build_shared_model(args, [AdapterSpec("policy", trainable=True)], vocab_size=vocab,
                              device=torch.device("cpu"))


class PoisonedStage:
    """The SFT stage, with a NaN loss on chosen micro-batch calls (1-based)."""

    name, trainable_adapters = "sft", ["policy"]

    def __init__(self, inner, poisoned_calls):
        self.inner, self.poisoned, self.calls = inner, set(poisoned_calls), 0

    def compute_loss(self, model, batch):
        self.calls += 1
        out = self.inner.compute_loss(model, batch)
        if self.calls in self.poisoned:
            out.loss = out.loss * float("nan")
        return out

    def evaluate(self, model, accelerator):
        return {}


def loop_args(tmp_path, **overrides):
    from trainer.config import TrainArguments

    values = dict(output_dir=str(tmp_path / "run"), max_steps=4, micro_batch_size=4, gradient_accumulation_steps=2,
                  learning_rate=1e-2, warmup_steps=0, eval_every=0, save_every=0, report_to="none",
                  progress_bar=False, max_bad_steps=2)
    values.update(overrides)
    return TrainArguments(**values)


def test_nan_loss_skips_the_step_counts_it_and_leaves_weights_untouched(tiny_sft_data, smol_tokenizer, tmp_path,
                                                                        fresh_accelerate_state):
    from trainer.collators import SFTCollator
    from trainer.loop import make_accelerator, run_training
    from trainer.sft import SFTStage

    train, held_out = tiny_sft_data
    args = loop_args(tmp_path)
    accelerator = make_accelerator(args)
    model = tiny_policy(len(smol_tokenizer))
    collate = SFTCollator(smol_tokenizer.pad_token_id)
    # Micro-batch calls 3 and 4 make optimizer step 2: poison call 4 only.
    stage = PoisonedStage(SFTStage(held_out, collate, 4, 1), poisoned_calls=[4])
    before_step, after_step = [], []
    real_step = torch.optim.AdamW.step

    def recording_step(self, *a, **kw):
        before_step.append([p.detach().clone() for p in model.trainable_parameters()])
        result = real_step(self, *a, **kw)
        after_step.append([p.detach().clone() for p in model.trainable_parameters()])
        return result

    torch.optim.AdamW.step = recording_step
    try:
        run_training(stage, model, train, collate, args, accelerator)
    finally:
        torch.optim.AdamW.step = real_step
    assert len(before_step) == 3  # steps 1, 3, 4 stepped; step 2 was skipped
    # Between the end of step 1 and the start of step 3 nothing moved: the poisoned step 2 changed nothing.
    assert all(torch.equal(a, b) for a, b in zip(after_step[0], before_step[1]))
    assert not all(torch.equal(a, b) for a, b in zip(before_step[0], after_step[0]))
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "train/skipped_steps" in r]
    assert [r["train/skipped_steps"] for r in train_rows] == [0.0, 1.0, 1.0, 1.0]
    assert all(torch.isfinite(p).all() for p in model.trainable_parameters())


def test_consecutive_nan_losses_stop_the_run_with_a_clear_message(tiny_sft_data, smol_tokenizer, tmp_path,
                                                                   fresh_accelerate_state):
    from trainer.collators import SFTCollator
    from trainer.loop import TrainingDiverged, make_accelerator, run_training
    from trainer.sft import SFTStage

    train, held_out = tiny_sft_data
    args = loop_args(tmp_path, max_steps=10)
    accelerator = make_accelerator(args)
    model = tiny_policy(len(smol_tokenizer))
    collate = SFTCollator(smol_tokenizer.pad_token_id)
    stage = PoisonedStage(SFTStage(held_out, collate, 4, 1), poisoned_calls=range(3, 100))
    before = [p.detach().clone() for p in model.trainable_parameters()]
    with pytest.raises(TrainingDiverged, match="2 steps in a row had a NaN/inf loss or gradient \\(at step 3\\)"):
        run_training(stage, model, train, collate, args, accelerator)
    after = model.trainable_parameters()
    assert not all(torch.equal(a, b) for a, b in zip(before, after))  # step 1 trained
    assert all(torch.isfinite(p).all() for p in after)


def test_sft_loss_is_cross_entropy_on_completion_tokens_only(tiny_sft_data, smol_tokenizer):
    import torch.nn.functional as F

    from trainer.collators import SFTCollator
    from trainer.sft import SFTStage

    train, held_out = tiny_sft_data
    examples = train[:3]
    batch = SFTCollator(smol_tokenizer.pad_token_id)(examples)
    model = tiny_policy(len(smol_tokenizer)).eval()
    stage = SFTStage(held_out, SFTCollator(smol_tokenizer.pad_token_id), 4, 1)
    loss = stage.compute_loss(model, batch).loss
    logits = model(batch["input_ids"], batch["attention_mask"], adapter="policy")
    # Hand-built: predict token t+1 from position t, only where t+1 is a completion token.
    terms = []
    for row, ex in enumerate(examples):
        start, end = len(ex.prompt_ids), len(ex.input_ids)
        for t in range(start, end):
            terms.append(F.cross_entropy(logits[row, t - 1], torch.tensor(ex.input_ids[t])))
    torch.testing.assert_close(loss, torch.stack(terms).mean())
    # The prompt carries no gradient: perturbing prompt positions' logits leaves the loss alone.
    logits = logits.detach().requires_grad_(True)
    from trainer.losses import completion_ce_sum

    total, count = completion_ce_sum(logits, batch["labels"])
    (total / count).backward()
    for row, ex in enumerate(examples):
        assert logits.grad[row, : len(ex.prompt_ids) - 1].abs().sum() == 0
        assert logits.grad[row, len(ex.prompt_ids) - 1].abs().sum() > 0  # predicts the first completion token
    assert int(count) == sum(len(ex.completion_ids) for ex in examples)


def test_resuming_under_other_data_settings_is_refused_naming_the_fields(uninterrupted, tmp_path):
    out = tmp_path / "changed"
    shutil.copytree(uninterrupted, out)
    proc = subprocess.run([sys.executable, str(ROOT / "trainer" / "sft.py"), "--config", str(TINY_SFT),
                           "--output_dir", str(out), "--max_length", "64", "--learning_rate", "0.01"],
                          cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode != 0
    message = proc.stdout + proc.stderr
    assert "would resume from checkpoint-0000008" in message, message[-2000:]
    assert "data.max_length: 96 -> 64" in message and "train.learning_rate: 0.002 -> 0.01" in message
    assert "--resume no" in message
    assert json.loads((out / "config.json").read_text())["data"]["max_length"] == 96  # nothing overwritten


def test_resume_config_check_lets_run_length_and_evaluation_settings_change():
    from trainer.run import resume_config_changes

    saved = {"train": {"max_steps": 8, "eval_every": 4, "seed": 0}, "data": {"max_length": 96},
             "stage": {"eval_prompts": 8, "beta": 0.1}}
    longer = {"train": {"max_steps": 20, "eval_every": 10, "seed": 0, "resume_config_check": True},
              "data": {"max_length": 96}, "stage": {"eval_prompts": 32, "beta": 0.1}}
    assert resume_config_changes(saved, longer) == []
    other = {"train": {"max_steps": 8, "eval_every": 4, "seed": 1}, "data": {"max_length": 96},
             "stage": {"eval_prompts": 8, "beta": 0.2}}
    assert resume_config_changes(saved, other) == ["train.seed: 0 -> 1", "stage.beta: 0.1 -> 0.2"]
