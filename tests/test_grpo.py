"""The critic-free stage (trainer/grpo.py): GRPO and RLOO on the shared base, run as a user runs them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import adapter_state

ROOT = Path(__file__).resolve().parent.parent
TINY_GRPO = ROOT / "tests" / "configs" / "tiny_grpo.yaml"


@pytest.mark.parametrize("extra, adapters", [
    ((), ["policy", "reference"]),  # GRPO, k3 KL term against the reference
    (("--advantage", "rloo", "--beta", "0"), ["policy"]),  # beta 0: no reference pass at all
])
def test_a_grpo_run_trains_only_the_policy_and_logs_trl_named_figures(tmp_path, extra, adapters, monkeypatch,
                                                                      fresh_accelerate_state):
    import trainer.grpo as grpo

    built = {}
    original = grpo.build_model

    def spy(ctx):
        model = original(ctx)
        built["model"] = model
        built["before"] = {name: adapter_state(model, name) for name in model.adapter_names}
        return model

    monkeypatch.setattr(grpo, "build_model", spy)
    grpo.main(["--config", str(TINY_GRPO), "--output_dir", str(tmp_path / "run"), *extra])
    model = built["model"]
    assert model.adapter_names == adapters and "value" not in model.adapter_names
    for name, state in built["before"].items():
        moved = any(not torch.equal(v, adapter_state(model, name)[k]) for k, v in state.items())
        assert moved == (name == "policy"), name
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward" in r]
    assert steps and {"reward", "reward_std", "clip_ratio", "completions/mean_length", "loss",
                      "perf/decode_tokens_per_s"} <= set(steps[-1])
    assert ("kl" in steps[-1]) == ("reference" in adapters)
    assert (tmp_path / "run" / "adapter" / "adapter_model.safetensors").is_file()


def test_rloo_with_one_response_per_prompt_is_refused_in_one_line(tmp_path, capsys):
    import trainer.grpo as grpo
    from foundation.cli import run

    with pytest.raises(SystemExit) as exit_info:
        run(grpo.main, ["--config", str(TINY_GRPO), "--output_dir", str(tmp_path / "run"), "--advantage", "rloo",
                        "--num_generations", "1"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: --advantage rloo needs --num_generations of at least 2")


def test_the_estimator_knows_the_critic_free_stage():
    from profiling.predict import EstimateArguments, estimate
    from profiling.shapes import load_shape

    shape = load_shape("llama-2-7b")
    grpo = estimate(shape, EstimateArguments(stage="grpo", rollout_batch_size=16, num_generations=4,
                                             rollout_micro_batch_size=16, max_new_tokens=128))
    ppo = estimate(shape, EstimateArguments(stage="ppo", rollout_batch_size=16, rollout_micro_batch_size=16,
                                            max_new_tokens=128))
    assert [p["phase"] for p in grpo["phases"]] == ["generate", "score", "update", "optimizer_step"]
    g, p = ({x["phase"]: x["components"] for x in e["phases"]} for e in (grpo, ppo))
    assert "adapter/value" not in g["update"] and "adapter/value" in p["update"]
    assert g["update"]["activations"] < p["update"]["activations"]  # one forward, not policy + value
    # token ids and attention mask (int64) over 256 + 128 positions, six fp32 series over the 128 generated
    buffers = {rows: rows * (256 + 128) * 8 * 2 + 6 * rows * 128 * 4 for rows in (64, 16)}
    assert g["score"]["rollout_buffers"] == buffers[64]  # 64 responses
    assert p["score"]["rollout_buffers"] == buffers[16]


def test_out_of_memory_in_the_grpo_update_retries_with_half_the_micro_batch(tmp_path, monkeypatch, capsys,
                                                                             fresh_accelerate_state):
    import trainer.grpo as grpo
    import trainer.rl.algorithms.grpo as grpo_maths

    real, seen = grpo_maths.response_logprobs, []

    def flaky(model, ids, *args, **kwargs):
        seen.append(ids.shape[0])
        if ids.shape[0] > 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return real(model, ids, *args, **kwargs)

    monkeypatch.setattr(grpo_maths, "response_logprobs", flaky)
    results = grpo.main(["--config", str(TINY_GRPO), "--output_dir", str(tmp_path / "run")])
    assert results["update_micro_batch"] == 2
    assert seen[0] == 4 and set(seen[1:]) == {2}
    assert "out of memory in the GRPO update: retrying the minibatch with micro-batch 2" in capsys.readouterr().out
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["perf/update_micro_batch"] for r in rows if "perf/update_micro_batch" in r] == [2.0]


def test_grpo_old_logprobs_read_while_sampling_equal_a_policy_scoring_pass(tmp_path, fresh_accelerate_state):
    """The critic-free rollout reads the old log-probs while sampling, as PPO's does: what a policy scoring
    pass over the sampled rows gives, to fp32 tolerance; the reference's log-probs differ from them."""
    from foundation.settings import GRPOArguments
    from trainer.data.collators import PromptCollator
    from trainer.data.tokenization import tokenize_prompts
    from trainer.engine.setup import start_run
    from trainer.grpo import build_model
    from trainer.model.decode import Generator, Sampling
    from trainer.rl.rollout import make_rollout
    from trainer.rl.scoring import response_logprobs
    from trainer.rl.settings import make_scorer

    ctx = start_run(GRPOArguments, ["--config", str(TINY_GRPO), "--output_dir", str(tmp_path / "run"),
                                    "--temperature", "0.8"])
    model = build_model(ctx)
    torch.manual_seed(5)
    with torch.no_grad():
        for p, adapter in model._lora_params:
            if adapter == "policy":  # the policy off the reference: the two log-probs differ
                p.add_(torch.randn_like(p) * 0.3)
    tok = ctx.tokenizer
    prompts, _ = tokenize_prompts(ctx.splits.ppo[:2], tok, ctx.data_args)
    batch = PromptCollator(tok.pad_token_id)(prompts)
    scorer = make_scorer(ctx.stage_args, tok)
    torch.manual_seed(0)
    sampled = make_rollout(Generator(model, rows=ctx.plan.rollout_micro_batch_size), batch["input_ids"], batch["attention_mask"], ctx.stage_args, scorer,
                           tok.eos_token_id, tok.pad_token_id, group=ctx.stage_args.num_generations)
    model.eval()
    with torch.no_grad():
        scored, _ = response_logprobs(model, sampled.input_ids, sampled.attention_mask,
                                      sampled.response_mask.shape[1], "policy",
                                      Sampling.of(ctx.stage_args).scoring_temperature)
    torch.testing.assert_close(sampled.logprobs, scored * sampled.response_mask, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(sampled.logprobs, sampled.ref_logprobs)



class FixedRolloutUpdate:
    """GRPO updates (`rl_step`, optimizer steps taken out) of one model over one fixed rollout of 2 prompts
    x 5 responses of unequal lengths: the gradient of each minibatch, for any batch settings."""

    LENGTHS = [1, 6, 2, 5, 3, 6, 1, 4, 2, 6]

    def __init__(self, tmp_path, monkeypatch):
        import trainer.rl.algorithms.grpo as grpo_maths
        import trainer.rl.online as online
        from foundation.settings import GRPOArguments
        from trainer.engine.harness import Engine
        from trainer.engine.setup import start_run
        from trainer.grpo import build_model
        from trainer.rl.rollout import Rollout
        from trainer.rl.scoring import response_logprobs

        ctx = start_run(GRPOArguments, ["--config", str(TINY_GRPO), "--output_dir", str(tmp_path / "run"),
                                        "--num_generations", "5"])
        torch.manual_seed(0)
        model = build_model(ctx)
        with torch.no_grad():
            for p, adapter in model._lora_params:
                if adapter == "policy":  # the policy off the reference: the k3 term has a gradient
                    p.add_(torch.randn_like(p) * 0.3)
        gen = torch.Generator().manual_seed(1)
        ids = torch.randint(3, len(ctx.tokenizer), (10, 12), generator=gen)
        att = torch.ones_like(ids)
        mask = (torch.arange(6) < torch.tensor(self.LENGTHS)[:, None]).float()
        with torch.no_grad():
            old, _ = response_logprobs(model, ids, att, 6, "policy")
            ref, _ = response_logprobs(model, ids, att, 6, "reference")
        scores = torch.tensor([0.0, 1.0, 3.0, -1.0, 0.5, 2.0, 2.0, -2.0, 1.0, 0.0])
        self.rollout = Rollout(ids, att, mask, 6, old * mask, ref * mask, None, scores,
                               torch.ones(10, dtype=torch.bool), torch.zeros_like(mask), group=5, generate_s=1.0)
        monkeypatch.setattr(online, "make_rollout", lambda *a, **k: self.rollout)
        self.oom_at, self.failed = 0, []
        real = grpo_maths.response_logprobs

        def flaky(model, ids, *a, **k):
            if ids.shape[0] == self.oom_at and not self.failed:
                self.failed.append(ids.shape[0])
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
            return real(model, ids, *a, **k)

        monkeypatch.setattr(grpo_maths, "response_logprobs", flaky)
        self.engine, self.grads = Engine(model, ctx.train_args, ctx.accelerator, "grpo"), []

        def no_step(finite=True):
            self.grads.append([p.grad.clone() for p in self.engine.params])
            self.engine.optimizer.zero_grad(set_to_none=True)
            return False, True, 0.0

        monkeypatch.setattr(self.engine, "optimizer_step", no_step)
        self.ctx = ctx

    def gradients(self, normalisation: str, mini_batch: int, micro_batch: int, oom_at: int = 0
                  ) -> list[list[torch.Tensor]]:
        """One update's gradient per minibatch; a forward of `oom_at` rows runs out of memory once."""
        from dataclasses import replace

        from trainer.model.decode import Generator
        from trainer.rl.algorithms.grpo import GRPO
        from trainer.rl.online import rl_step

        args = replace(self.ctx.stage_args, mini_batch_size=mini_batch, loss_normalisation=normalisation)
        self.oom_at, self.failed, self.grads = oom_at, [], []
        algorithm = GRPO(args)
        state = algorithm.start(micro_batch, seed=3)
        batch = {"input_ids": self.rollout.input_ids[::5, :6], "attention_mask": self.rollout.attention_mask[::5, :6]}
        rl_step(self.engine, Generator(self.engine.raw), batch, algorithm, state, None, 0, 0)  # the rollout: made up
        assert bool(self.failed) == bool(oom_at)
        assert state.micro_batch_size == (micro_batch // 2 if oom_at else micro_batch)
        return self.grads


def assert_same_gradients(a: list[list[torch.Tensor]], b: list[list[torch.Tensor]]) -> None:
    assert len(a) == len(b) and a
    for step_a, step_b in zip(a, b):
        assert any(g.abs().max() > 0 for g in step_a)
        for x, y in zip(step_a, step_b):
            torch.testing.assert_close(x, y, rtol=0, atol=1e-3 * float(x.abs().max()))  # fp32 reordering: ~1e-4


def test_token_normalisation_is_one_mean_over_the_minibatch_tokens_in_one_micro_batch_or_five(
        tmp_path, monkeypatch, fresh_accelerate_state):
    """DAPO: micro-batches of unequal token counts weigh by their tokens, not 1/5 each (TRL's bnpo per
    micro-batch); sequence and fixed stay means over rows."""
    update = FixedRolloutUpdate(tmp_path, monkeypatch)
    for normalisation in ("token", "sequence", "fixed"):
        whole = update.gradients(normalisation, mini_batch=10, micro_batch=10)
        assert len(whole) == 1
        assert_same_gradients(whole, update.gradients(normalisation, mini_batch=10, micro_batch=2))


def test_out_of_memory_halving_of_an_odd_micro_batch_leaves_every_row_its_weight(tmp_path, monkeypatch,
                                                                                 fresh_accelerate_state):
    """Micro-batch 5 halved to 2 runs each minibatch of 5 as 2 + 2 + 1: its gradient is the one of 5 at once."""
    update = FixedRolloutUpdate(tmp_path, monkeypatch)
    for normalisation in ("token", "sequence", "fixed"):
        whole = update.gradients(normalisation, mini_batch=5, micro_batch=5)
        assert len(whole) == 2
        assert_same_gradients(whole, update.gradients(normalisation, mini_batch=5, micro_batch=5, oom_at=5))
