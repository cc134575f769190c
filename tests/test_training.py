"""The shared loop: kill-and-resume equals an uninterrupted run, atomic checkpoints, NaN guard."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import in_process_command, killed_run
from safetensors.torch import load_file

from trainer.engine.checkpoint import complete_checkpoints

ROOT = Path(__file__).resolve().parent.parent
TINY_SFT = ROOT / "tests" / "configs" / "tiny_sft.yaml"
DETERMINISTIC_KEYS = ("train/loss", "train/grad_norm", "train/lr", "eval/loss", "eval/perplexity")


def run_sft(output_dir: Path, *extra: str) -> str:
    """`trainer/sft.py` on tiny_sft.yaml in this process, one thread (`in_process_command`): its log. Only the run
    that is killed needs a process of its own."""
    proc = in_process_command("trainer.sft", ["--config", str(TINY_SFT), "--output_dir", str(output_dir), *extra])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


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


def test_kill_during_a_checkpoint_write_leaves_the_previous_one_readable(uninterrupted, tmp_path, forks):
    out, killed_log = tmp_path / "killed-in-save", tmp_path / "killed.log"
    # killed once checkpoint 4's files are written, before it is published under its name
    killed_run(forks, "trainer.sft", ["--config", str(TINY_SFT), "--output_dir", str(out)], killed_log,
               die_at="checkpoint-0000004")
    assert (out / "checkpoint-0000004.tmp").is_dir()  # the half-published save is there...
    assert [p.name for p in complete_checkpoints(out)] == ["checkpoint-0000002"]  # ...and ignored
    log = run_sft(out)
    assert "resumed from" in log and "checkpoint-0000002" in log
    assert not (out / "checkpoint-0000004.tmp").exists()
    assert metric_rows(out) == metric_rows(uninterrupted)
    for key, value in adapter_weights(uninterrupted).items():
        assert torch.equal(value, adapter_weights(out)[key]), key


# ---- in-process harness tests on the tiny model -------------------------------------------------

@pytest.fixture(scope="module")
def tiny_sft_data(shared_data, smol_tokenizer):
    from foundation.settings import DataArguments
    from trainer.data.hh_rlhf import load_splits
    from trainer.data.tokenization import tokenize_sft

    args = DataArguments(dataset=str(shared_data / "harmless-base"), max_length=96, min_prompt_tokens=4,
                         eval_size=8, sft_size=48, reward_size=0, ppo_size=0)
    splits, _ = load_splits(args)
    train, _ = tokenize_sft(splits.sft, smol_tokenizer, args)
    held_out, _ = tokenize_sft(splits.eval, smol_tokenizer, args)
    return train, held_out


def tiny_policy(vocab: int, dropout: float = 0.0):
    from foundation.settings import ModelArguments
    from trainer.model.shared_base import AdapterSpec, build_shared_model

    args = ModelArguments(model_name_or_path="tiny-llama", lora_r=4, lora_alpha=8, lora_dropout=dropout,
                          gradient_checkpointing=False)
    return build_shared_model(args, [AdapterSpec("policy", trainable=True)], vocab_size=vocab,
                              device=torch.device("cpu"))


def poison_sft(monkeypatch, poisoned_calls):
    """SFT's training loss made NaN on chosen micro-batch calls (1-based; evaluation calls not counted)."""
    import trainer.sft as sft

    real, calls = sft.completion_nll, [0]

    def poisoned(model, batch, adapter):
        loss_sum, count = real(model, batch, adapter)
        if torch.is_grad_enabled():
            calls[0] += 1
            if calls[0] in poisoned_calls:
                loss_sum = loss_sum * float("nan")
        return loss_sum, count

    monkeypatch.setattr(sft, "completion_nll", poisoned)


def sft_argv(tmp_path, *extra):
    return ["--config", str(TINY_SFT), "--output_dir", str(tmp_path / "run"), "--learning_rate", "0.01",
            "--warmup_steps", "0", "--eval_every", "0", "--save_every", "0", "--max_bad_steps", "2",
            "--lora_dropout", "0.0", *extra]


def test_nan_loss_skips_the_step_counts_it_and_leaves_weights_untouched(tmp_path, monkeypatch,
                                                                        fresh_accelerate_state):
    import trainer.sft as sft

    # Micro-batch calls 3 and 4 make optimizer step 2 (accumulation 2): poison call 4 only.
    poison_sft(monkeypatch, [4])
    before_step, after_step = [], []
    real_step = torch.optim.AdamW.step

    def recording_step(self, *a, **kw):
        params = [p for group in self.param_groups for p in group["params"]]
        before_step.append([p.detach().clone() for p in params])
        result = real_step(self, *a, **kw)
        after_step.append([p.detach().clone() for p in params])
        return result

    monkeypatch.setattr(torch.optim.AdamW, "step", recording_step)
    sft.main(sft_argv(tmp_path, "--max_steps", "4"))
    assert len(before_step) == 3  # steps 1, 3, 4 stepped; step 2 was skipped
    # Between the end of step 1 and the start of step 3 nothing moved: the poisoned step 2 changed nothing.
    assert all(torch.equal(a, b) for a, b in zip(after_step[0], before_step[1]))
    assert not all(torch.equal(a, b) for a, b in zip(before_step[0], after_step[0]))
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "train/skipped_steps" in r]
    assert [r["train/skipped_steps"] for r in train_rows] == [0.0, 1.0, 1.0, 1.0]
    assert [r["train/lr"] for r in train_rows][1:3] == [train_rows[1]["train/lr"]] * 2  # the schedule waited
    assert all(torch.isfinite(p).all() for p in after_step[-1])


def test_consecutive_nan_losses_stop_the_run_with_a_clear_message(tmp_path, monkeypatch, fresh_accelerate_state):
    import trainer.sft as sft
    from trainer.engine.harness import TrainingDiverged

    poison_sft(monkeypatch, range(3, 100))
    with pytest.raises(TrainingDiverged, match="2 steps in a row had a NaN/inf loss or gradient \\(at step 3\\)"):
        sft.main(sft_argv(tmp_path, "--max_steps", "10"))
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "train/loss" in r] == [1, 2]  # step 1 trained, step 2 was the first bad
    assert not (tmp_path / "run" / "adapter").exists()


def test_sft_loss_is_cross_entropy_on_completion_tokens_only(tiny_sft_data, smol_tokenizer):
    import torch.nn.functional as F

    from trainer.data.collators import SFTCollator
    from trainer.sft import completion_nll

    train, _ = tiny_sft_data
    examples = train[:3]
    batch = SFTCollator(smol_tokenizer.pad_token_id)(examples)
    model = tiny_policy(len(smol_tokenizer)).eval()
    loss_sum, count = completion_nll(model, batch, "policy")
    logits = model(batch["input_ids"], batch["attention_mask"], adapter="policy")
    # Hand-built: predict token t+1 from position t, only where t+1 is a completion token.
    terms = []
    for row, ex in enumerate(examples):
        start, end = len(ex.prompt_ids), len(ex.input_ids)
        for t in range(start, end):
            terms.append(F.cross_entropy(logits[row, t - 1], torch.tensor(ex.input_ids[t])))
    torch.testing.assert_close(loss_sum / count, torch.stack(terms).mean())
    assert int(count) == sum(len(ex.completion_ids) for ex in examples)
    # The prompt carries no gradient: the hidden states at prompt positions before the last get none.
    hidden = {}
    handle = model.causal_lm.model.norm.register_forward_hook(lambda m, i, o: hidden.setdefault("h", o))
    model.train()
    loss_sum, _ = completion_nll(model, batch, "policy")
    handle.remove()
    hidden["h"].retain_grad()
    loss_sum.backward()
    for row, ex in enumerate(examples):
        assert hidden["h"].grad[row, : len(ex.prompt_ids) - 1].abs().sum() == 0
        assert hidden["h"].grad[row, len(ex.prompt_ids) - 1].abs().sum() > 0  # predicts the first completion token


def test_resuming_under_other_data_settings_is_refused_naming_the_fields(uninterrupted, tmp_path):
    out = tmp_path / "changed"
    shutil.copytree(uninterrupted, out)
    proc = in_process_command("trainer.sft", ["--config", str(TINY_SFT), "--output_dir", str(out), "--max_length", "64",
                                              "--learning_rate", "0.01"])
    assert proc.returncode != 0
    message = proc.stdout + proc.stderr
    assert "would resume from checkpoint-0000008" in message, message[-2000:]
    assert "data.max_length: 96 -> 64" in message and "train.learning_rate: 0.002 -> 0.01" in message
    assert "--resume no" in message
    assert json.loads((out / "config.json").read_text())["data"]["max_length"] == 96  # nothing overwritten


def test_resume_config_check_lets_run_length_evaluation_and_decoding_settings_change():
    """Run length, evaluation, and how rollouts decode (the path and the weights decoded from: speed only, as
    on another card the planner may choose otherwise) may change on resume; what is trained may not."""
    from trainer.engine.setup import resume_config_changes

    saved = {"train": {"max_steps": 8, "eval_every": 4, "seed": 0}, "data": {"max_length": 96},
             "stage": {"eval_prompts": 8, "beta": 0.1, "decode": "compiled", "generation_weights": "resident"}}
    longer = {"train": {"max_steps": 20, "eval_every": 10, "seed": 0, "resume_config_check": True},
              "data": {"max_length": 96},
              "stage": {"eval_prompts": 32, "beta": 0.1, "decode": "eager", "generation_weights": "quantized"}}
    assert resume_config_changes(saved, longer) == []
    other = {"train": {"max_steps": 8, "eval_every": 4, "seed": 1}, "data": {"max_length": 96},
             "stage": {"eval_prompts": 8, "beta": 0.2}}
    assert resume_config_changes(saved, other) == ["train.seed: 0 -> 1", "stage.beta: 0.1 -> 0.2"]


def test_length_grouping_orders_each_steps_rows_longest_first_and_keeps_every_step_its_rows():
    from trainer.engine.batches import EpochShuffleSampler

    lengths = [(i * 37) % 101 for i in range(50)]
    plain = list(EpochShuffleSampler(50, 3))
    grouped = list(EpochShuffleSampler(50, 3, lengths, window=8))
    for start in range(0, 50, 8):  # the last window is short: 50 = 6 x 8 + 2
        window = plain[start : start + 8]
        assert sorted(grouped[start : start + 8]) == sorted(window)  # the same rows in the same step
        assert [lengths[i] for i in grouped[start : start + 8]] == sorted((lengths[i] for i in window), reverse=True)
    assert grouped != plain
    again = EpochShuffleSampler(50, 3, lengths, window=8)
    again.set_epoch(1)
    assert list(again) != grouped and sorted(again) == list(range(50))  # a fresh order each epoch, every row once


def step_rows(length_window: int, ranks: int, micro_batch: int = 4, accumulation: int = 5, epochs: int = 4,
              size: int = 50) -> tuple[list[list[int]], list[set[int]]]:
    """(rows of each optimizer step in the order the ranks' micro-batches hold them, rows read in each epoch)
    from `make_loader` dealt to `ranks` ranks by Accelerate's batch sharding, over `epochs` epochs."""
    from types import SimpleNamespace

    from accelerate.data_loader import BatchSamplerShard

    from trainer.engine.batches import make_loader

    dataset = [SimpleNamespace(index=i, length=(i * 37) % 101) for i in range(size)]
    loader, sampler = make_loader(dataset, lambda rows: [r.index for r in rows], micro_batch, 3, length_window,
                                  **({"ranks": ranks} if ranks > 1 else {}))
    local: list[list[list[int]]] = [[] for _ in range(ranks)]  # rank -> its micro-batches, epoch after epoch
    read = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        shards = [list(BatchSamplerShard(loader.batch_sampler, ranks, rank)) for rank in range(ranks)]
        read.append({i for shard in shards for batch in shard for i in batch})
        for rank, shard in enumerate(shards):
            local[rank] += shard
    steps = len(local[0]) // accumulation
    rows = [[i for k in range(s * accumulation, (s + 1) * accumulation) for rank in range(ranks)
             for i in local[rank][k]] for s in range(steps)]
    return rows, read


@pytest.mark.parametrize("ranks", [1, 2])
def test_length_grouped_steps_train_on_the_plain_shuffles_rows_in_every_epoch(ranks):
    # 50 rows in micro-batches of 4 x 5 accumulated: an epoch reads 48 rows (12 batches), a step 20 x ranks,
    # so steps straddle epochs and the epoch's last 2 rows are dropped.
    window = 4 * 5 * ranks
    plain, plain_read = step_rows(0, ranks)
    grouped, grouped_read = step_rows(window, ranks)
    lengths = [(i * 37) % 101 for i in range(50)]
    assert len(plain) == len(grouped) == 4 * 48 // window
    for step, (a, b) in enumerate(zip(plain, grouped)):
        assert sorted(b) == sorted(a), f"step {step + 1}"  # the same rows in the same step
    assert grouped_read == plain_read  # the epochs drop the same rows
    assert grouped != plain
    # A step within one epoch holds its rows longest first (ranks take micro-batches in turn).
    first = [lengths[i] for i in grouped[0]]
    assert first == sorted(first, reverse=True)


def first_step_gradient(monkeypatch, tmp_path, *extra) -> tuple[dict[str, torch.Tensor], list[int]]:
    """(the gradient of SFT's first optimizer step, before clipping; the completion tokens of each of its
    micro-batches) on tiny_sft's real hh-rlhf rows, with no dropout."""
    import trainer.sft as sft
    from trainer.engine.harness import Engine

    gradients, counts = [], []
    real_step, real_nll = Engine.optimizer_step, sft.completion_nll

    def recording_step(self, finite=True):
        gradients.append({n: p.grad.detach().clone() for n, p in self.model.named_parameters() if p.grad is not None})
        return real_step(self, finite)

    def counting_nll(model, batch, adapter):
        loss_sum, count = real_nll(model, batch, adapter)
        if torch.is_grad_enabled():
            counts.append(int(count))
        return loss_sum, count

    with monkeypatch.context() as patch:
        patch.setattr(Engine, "optimizer_step", recording_step)
        patch.setattr(sft, "completion_nll", counting_nll)
        sft.main(sft_argv(tmp_path, "--max_steps", "1", "--eval_batches", "1", *extra))
    return gradients[0], counts


def test_one_sft_step_has_the_same_gradient_with_and_without_length_grouping(tmp_path, monkeypatch,
                                                                             fresh_accelerate_state):
    """Every completion token of a step weighs the same: grouping the step's rows into other micro-batches
    changes the gradient by float rounding only."""
    plain, plain_counts = first_step_gradient(monkeypatch, tmp_path / "plain", "--group_by_length", "false")
    grouped, grouped_counts = first_step_gradient(monkeypatch, tmp_path / "grouped", "--group_by_length", "true")
    # The same step's tokens, split otherwise: 2 micro-batches of 4 rows each (tiny_sft).
    assert len(plain_counts) == len(grouped_counts) == 2 and sum(plain_counts) == sum(grouped_counts)
    assert sorted(plain_counts) != sorted(grouped_counts)
    assert plain.keys() == grouped.keys() and len(plain) > 0
    difference = torch.cat([(grouped[k] - plain[k]).flatten() for k in plain]).norm()
    size = torch.cat([plain[k].flatten() for k in plain]).norm()
    print(f"relative gradient difference, grouped vs not: {float(difference / size):.2e}")
    assert size > 0 and difference / size < 1e-6, float(difference / size)


def test_adamw_runs_torchs_fused_kernel_where_it_can_and_steps_as_the_default_adamw():
    from trainer.engine.optim import build_optimizer, fused_adamw

    def params(seed: int) -> list[torch.nn.Parameter]:
        g = torch.Generator().manual_seed(seed)
        return [torch.nn.Parameter(torch.randn(16, 8, generator=g)), torch.nn.Parameter(torch.randn(8, generator=g))]

    ours, plain = params(0), params(0)
    opt = build_optimizer(ours, "adamw_torch", 1e-2, 0.1, torch.device("cpu"))
    assert opt.defaults["fused"] and opt.resolved_name == "adamw_torch (fused kernel)"
    reference = torch.optim.AdamW([{"params": [plain[0]], "weight_decay": 0.1}, {"params": [plain[1]], "weight_decay": 0.0}],
                                  lr=1e-2, betas=(0.9, 0.999), eps=1e-8, foreach=False)
    for step in range(5):
        g = torch.Generator().manual_seed(100 + step)
        for a, b in zip(ours, plain):
            a.grad = torch.randn(a.shape, generator=g)
            b.grad = a.grad.clone()
        opt.step()
        reference.step()
    for a, b in zip(ours, plain):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    saved = opt.state_dict()
    for group in saved["param_groups"]:
        group["fused"] = None  # a checkpoint written before the fused kernel
    opt.load_state_dict(saved)
    assert all(group["fused"] for group in opt.param_groups)  # this run's kernel stays
    assert not build_optimizer(params(1), "adamw_torch", 1e-2, 0.1, torch.device("cpu"), fused=False).defaults["fused"]
    assert not fused_adamw([torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))])
    partitioned = torch.nn.Parameter(torch.zeros(2))
    partitioned.ds_id = 0  # a DeepSpeed ZeRO-3 parameter
    assert not fused_adamw([partitioned])


def test_eval_size_0_holds_nothing_out_and_writes_no_evaluation_figures(tmp_path, fresh_accelerate_state):
    """--eval_size 0 (as sft_size 0 and the others, none): no evaluation, rather than a loss of 0.0 and a
    perplexity of 1.0 over zero examples."""
    import trainer.sft as sft

    results = sft.main(sft_argv(tmp_path, "--max_steps", "2", "--eval_size", "0"))
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and not [k for r in rows for k in r if k.startswith("eval/")]
    assert results["eval_before"] is None and results["eval_after"] is None
    assert (tmp_path / "run" / "adapter" / "adapter_model.safetensors").is_file()
