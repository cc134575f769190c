"""The RL step wiring around the pure losses: what `compute_advantages`, the PPO and GRPO updates, the
rollouts' missing-EOS penalty and the DPO step feed the maths, pinned by numbers computed here
independently (plain Python, or the test's own forward passes) and by the direction one update moves.

tests/mutants/run.py applies one-line changes to that wiring and reports which of these fail."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from trainer.model.decode import Generator

ROOT = Path(__file__).resolve().parent.parent
TINY_PPO = ROOT / "tests" / "configs" / "tiny_ppo.yaml"
TINY_GRPO = ROOT / "tests" / "configs" / "tiny_grpo.yaml"


# ---------------------------------------------------------------- plain-Python references


def mean_and_var(xs: list[float]) -> tuple[float, float]:
    """Mean and unbiased variance."""
    mean = sum(xs) / len(xs)
    return mean, sum((x - mean) ** 2 for x in xs) / (len(xs) - 1)


def hand_gae(rewards: list[float], values: list[float], gamma: float, lam: float) -> tuple[list[float], list[float]]:
    """(advantages, returns) of one response, backwards over its tokens; the value after the last is 0."""
    advantages, next_value, next_advantage = [0.0] * len(rewards), 0.0, 0.0
    for t in reversed(range(len(rewards))):
        delta = rewards[t] + gamma * next_value - values[t]
        next_advantage = delta + gamma * lam * next_advantage
        advantages[t], next_value = next_advantage, values[t]
    return advantages, [a + v for a, v in zip(advantages, values)]


def hand_kl(logp: float, ref: float, estimator: str) -> float:
    log_ratio = logp - ref
    return log_ratio if estimator == "k1" else math.exp(-log_ratio) - 1 + log_ratio  # k3


def own_logprobs(model, input_ids, attention_mask, prompt_length: int, adapter: str) -> torch.Tensor:
    """(B, R) log p of the response tokens under `adapter`'s full softmax, from this test's own forward."""
    with torch.no_grad():
        logits = model.logits(input_ids, attention_mask, adapter)[:, prompt_length - 1 : -1].double()
    return logits.log_softmax(-1).gather(-1, input_ids[:, prompt_length:].unsqueeze(-1)).squeeze(-1)


def perturb(model, adapter: str, scale: float = 0.3, seed: int = 3) -> None:
    """Move `adapter`'s LoRA weights off the fresh (B = 0) start, so it differs from the others."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p, owner in model._lora_params:
            if owner == adapter:
                p.add_(torch.randn_like(p) * scale)


# ---------------------------------------------------------------- PPO: rewards, GAE, whitening


LOGP = [[-1.0, -0.5, -2.0, 0.0], [-0.3, -1.2, -0.7, -0.9]]
REF = [[-1.2, -0.4, -2.5, 0.0], [-0.3, -1.0, -1.0, -0.6]]
VALUES = [[0.5, -0.2, 0.1, 0.0], [0.3, 0.0, -0.4, 0.2]]
LENGTHS = [3, 4]
SCORES = [1.0, -2.0]


def tiny_rollout():
    """Two responses of 3 and 4 tokens (the first right-padded), policy off its reference."""
    from trainer.rl.rollout import Rollout

    mask = torch.tensor([[1.0] * n + [0.0] * (4 - n) for n in LENGTHS])
    return Rollout(input_ids=torch.zeros(2, 6, dtype=torch.long), attention_mask=torch.ones(2, 6, dtype=torch.long),
                   response_mask=mask, prompt_length=2, logprobs=torch.tensor(LOGP), ref_logprobs=torch.tensor(REF),
                   values=torch.tensor(VALUES), scores=torch.tensor(SCORES), ended=torch.tensor([True, False]),
                   entropy=torch.zeros(2, 4))


@pytest.mark.parametrize("estimator, whiten_rewards", [("k1", False), ("k3", True)])
def test_ppo_rewards_advantages_and_returns_match_hand_computed_gae(estimator, whiten_rewards):
    """`compute_advantages` on a rollout whose policy differs from its reference, gamma != lambda: the KL
    penalty -beta * kl on every token, the score on the last one, GAE with (gamma, lambda) in that order,
    returns = advantages + values, then advantages whitened over the valid tokens - every number by hand."""
    from trainer.rl.algorithms.ppo import compute_advantages

    beta, gamma, lam = 0.1, 0.9, 0.5
    args = SimpleNamespace(kl_estimator=estimator, whiten_rewards=whiten_rewards, gamma=gamma, lam=lam)
    got = compute_advantages(tiny_rollout(), beta, args)

    kls = [[hand_kl(LOGP[b][t], REF[b][t], estimator) for t in range(n)] for b, n in enumerate(LENGTHS)]
    rewards = [[-beta * k for k in row] for row in kls]
    for b, n in enumerate(LENGTHS):
        rewards[b][n - 1] += SCORES[b]
    if whiten_rewards:  # scaled to unit variance over the valid tokens, the mean kept
        mean, var = mean_and_var([r for row in rewards for r in row])
        rewards = [[(r - mean) / math.sqrt(var + 1e-8) + mean for r in row] for row in rewards]
    gaes = [hand_gae(rewards[b], VALUES[b][:n], gamma, lam) for b, n in enumerate(LENGTHS)]
    mean, var = mean_and_var([a for advantages, _ in gaes for a in advantages])
    whitened = [[(a - mean) / math.sqrt(var + 1e-8) for a in advantages] for advantages, _ in gaes]

    def padded(rows):
        return torch.tensor([row + [0.0] * (4 - len(row)) for row in rows])

    torch.testing.assert_close(got.kl, padded(kls))
    torch.testing.assert_close(got.non_score_reward, padded([[-beta * k for k in row] for row in kls]))
    torch.testing.assert_close(got.rewards, padded(rewards))
    torch.testing.assert_close(got.returns, padded([returns for _, returns in gaes]))
    torch.testing.assert_close(got.advantages, padded(whitened))
    # the policy is more likely than the reference on most tokens: the penalty lowers the rewards
    assert float(got.non_score_reward.sum()) < 0


# ---------------------------------------------------------------- PPO: one update on the tiny model


def ppo_engine(tmp_path, *extra):
    """(ctx, model, engine) as trainer/ppo.py makes them on the tiny random Llama, the policy off its reference."""
    from foundation.settings import PPOArguments
    from trainer.engine.harness import Engine
    from trainer.engine.setup import start_run
    from trainer.ppo import build_model

    ctx = start_run(PPOArguments, ["--config", str(TINY_PPO), "--output_dir", str(tmp_path / "run"), *extra])
    model = build_model(ctx)
    perturb(model, "policy")
    return ctx, model, Engine(model, ctx.train_args, ctx.accelerator, "ppo")


def prompt_batch(ctx, rows: int) -> dict[str, torch.Tensor]:
    from trainer.data.collators import PromptCollator
    from trainer.data.tokenization import tokenize_prompts

    prompts, _ = tokenize_prompts(ctx.splits.ppo[:rows], ctx.tokenizer, ctx.data_args)
    return PromptCollator(ctx.tokenizer.pad_token_id)(prompts)


def full_length_rollout(ctx, model, rows: int = 4):
    """A rollout whose responses all run to max_new_tokens (min_new_tokens bars an early EOS)."""
    from trainer.rl.rollout import make_rollout
    from trainer.rl.settings import make_scorer

    args, tok = ctx.stage_args, ctx.tokenizer
    batch = prompt_batch(ctx, rows)
    torch.manual_seed(0)
    rollout = make_rollout(Generator(model, rows=rows), batch["input_ids"], batch["attention_mask"],
                           args, make_scorer(args, tok), tok.eos_token_id,
                           tok.pad_token_id, value=True)
    assert rollout.response_mask.sum() == rows * args.max_new_tokens
    return rollout


def test_one_ppo_update_raises_positive_advantage_tokens_lowers_negative_ones_and_fits_the_values(
        tmp_path, fresh_accelerate_state):
    """One optimizer step of PPO's update (`rl_update`) with advantages set by hand (+1 on two responses, -0.5 on the
    other two) and returns one above the rollout's values: the policy's log-probs of the +1 tokens rise
    and of the -0.5 tokens fall, the values move up towards the returns. And the minibatch, accumulated
    over two micro-batches, has the gradient (norm) and losses of the whole minibatch in one pass."""
    from trainer.rl.algorithms.ppo import PPO, Advantages, micro_loss
    from trainer.rl.online import rl_update
    from trainer.rl.scoring import policy_and_values

    ctx, model, engine = ppo_engine(tmp_path, "--min_new_tokens", "6", "--learning_rate", "0.002")
    args = replace(ctx.stage_args, ppo_epochs=1, mini_batch_size=4)
    rollout = full_length_rollout(ctx, model)
    ids, att, p, width = rollout.input_ids, rollout.attention_mask, rollout.prompt_length, rollout.response_length
    sign = torch.tensor([1.0, -0.5, 1.0, -0.5]).unsqueeze(1).expand(4, width)
    adv = Advantages(rewards=torch.zeros_like(sign), non_score_reward=torch.zeros_like(sign),
                     kl=torch.zeros_like(sign), advantages=sign.clone(), returns=rollout.values + 1.0)
    before = own_logprobs(model, ids, att, p, "policy")
    with torch.no_grad():
        values_before = policy_and_values(model, ids, att, width, 1.0)[2]  # the update's values

    # the whole minibatch in one pass: its gradient norm and losses
    engine.model.train()
    loss, whole = micro_loss(engine.model, rollout, adv.advantages, adv.returns, args, 1.0)
    loss.backward()
    norm = math.sqrt(sum(float(q.grad.double().pow(2).sum()) for q in engine.params if q.grad is not None))
    engine.optimizer.zero_grad(set_to_none=True)

    algorithm = PPO(args)
    state = algorithm.start(micro_batch_size=2, seed=0)
    stats, finite, stepped = rl_update(engine, algorithm, rollout, adv, state, 1.0)
    assert finite and stepped
    assert stats["policy/grad_norm"] == pytest.approx(norm, rel=1e-4)
    for key in ("loss/policy_avg", "loss/value_avg"):
        assert stats[key] == pytest.approx(float(whole[key]), rel=1e-4, abs=1e-7), key
    assert stats["loss/policy_avg"] == pytest.approx(-0.25, rel=1e-4)  # ratio 1: -(mean advantage)

    model.eval()
    moved = own_logprobs(model, ids, att, p, "policy") - before
    up, down = moved[sign[:, 0] > 0], moved[sign[:, 0] < 0]
    assert up.mean() > 0 > down.mean(), (up, down)
    with torch.no_grad():
        values_moved = policy_and_values(model, ids, att, width, 1.0)[2] - values_before
    assert values_moved.mean() > 0, values_moved


def test_ppo_step_tracks_its_rollout_buffers_at_their_exact_bytes(tmp_path, fresh_accelerate_state):
    """The memory report's rollout_buffers in PPO's update phase: the token ids (int64) and six fp32
    (B, R) series - log-probs, reference log-probs, values, advantages, returns, rewards."""
    from profiling import components as C
    from trainer.engine.phases import watching
    from trainer.rl.algorithms.ppo import PPO
    from trainer.rl.online import rl_step
    from trainer.rl.settings import make_scorer

    ctx, model, engine = ppo_engine(tmp_path, "--min_new_tokens", "6", "--profile_memory", "true")
    args, tok = replace(ctx.stage_args, rollout_batch_size=4, ppo_epochs=1), ctx.tokenizer
    batch = prompt_batch(ctx, 4)
    algorithm = PPO(args)
    state = algorithm.start(ctx.plan.micro_batch_size, 0)
    with watching(engine.recorder.phase):
        rl_step(engine, Generator(engine.raw, rows=args.rollout_micro_batch_size),
                batch, algorithm, state, make_scorer(args, tok), tok.eos_token_id, tok.pad_token_id)
    rows, prompt, response = 4, batch["input_ids"].shape[1], args.max_new_tokens
    expected = rows * (prompt + response) * 8 + 6 * rows * response * 4
    assert engine.recorder.records[("ppo", "update")].components[C.ROLLOUT_BUFFERS] == expected


def test_a_grpo_step_reports_its_rollout_buffers_and_saved_activations_as_ppo_does(tmp_path, fresh_accelerate_state):
    """The same step records GRPO's memory as PPO's: rollout_buffers in the update phase at their exact bytes -
    token ids (int64), the old and reference log-probs (fp32, rows x response) and one advantage and one reward
    per response (fp32) - and the bytes the first update saves for backward."""
    from profiling import components as C
    from trainer.engine.phases import watching
    from trainer.rl.algorithms.grpo import GRPO
    from trainer.rl.online import rl_step

    ctx, model, engine = grpo_context(tmp_path, "--min_new_tokens", "6", "--profile_memory", "true")
    args, tok = ctx.stage_args, ctx.tokenizer
    algorithm = GRPO(args)
    batch = prompt_batch(ctx, 2)
    with watching(engine.recorder.phase):
        rl_step(engine, Generator(engine.raw, rows=args.rollout_micro_batch_size),
                batch, algorithm, algorithm.start(ctx.plan.micro_batch_size, 0),
                FixedScores([1.0, 0.0, 2.0, 0.5] * 2), tok.eos_token_id, tok.pad_token_id)
    rows, prompt, response = 2 * args.num_generations, batch["input_ids"].shape[1], args.max_new_tokens
    update = engine.recorder.records[("grpo", "update")]
    assert update.components[C.ROLLOUT_BUFFERS] == rows * (prompt + response) * 8 + 2 * rows * response * 4 + 2 * rows * 4
    assert update.saved_for_backward and update.saved_for_backward > 0
    assert {("grpo", "generate"), ("grpo", "score"), ("grpo", "optimizer_step")} <= set(engine.recorder.records)


# ---------------------------------------------------------------- missing-EOS penalty


class FixedScores:
    """A scorer that gives the i-th row `scores[i]` and keeps what it was shown (the rollout's tokens, and
    the policy's and reference's log-probs of them before any update, from the test's own passes)."""

    adapter = None  # no reward adapter pass

    def __init__(self, scores, reference: bool = False):
        self.scores, self.reference, self.seen = scores, reference, {}

    def score(self, model, input_ids, attention_mask, prompt_length, response_mask, examples=None,
              adapter_scores=None, nan_unscored=False):
        return self(model, input_ids, attention_mask, prompt_length, response_mask), {}

    def __call__(self, model, input_ids, attention_mask, prompt_length, response_mask):
        self.seen = {"input_ids": input_ids, "attention_mask": attention_mask, "prompt_length": prompt_length,
                     "response_mask": response_mask.float(),
                     "policy": own_logprobs(model, input_ids, attention_mask, prompt_length, "policy")}
        if self.reference:
            self.seen["reference"] = own_logprobs(model, input_ids, attention_mask, prompt_length, "reference")
        return torch.tensor(self.scores[: input_ids.shape[0]], dtype=torch.float32)


def early_eos(sample, prompt_length: int) -> int:
    """A token that row 0 samples third, to stand in for EOS: the untrained model seldom samples the real
    one, and with the same seed row 0 then stops there while the other rows run on."""
    return int(sample().input_ids[0, prompt_length + 2])


def expected_after_penalty(input_ids, prompt_length: int, eos: int, scores, penalty: float) -> list[float]:
    ended = [eos in row[prompt_length:].tolist() for row in input_ids]
    assert any(ended) and not all(ended)
    return [s if e else s - penalty for s, e in zip(scores, ended)]


def test_ppo_rollout_subtracts_the_missing_eos_penalty_from_responses_without_eos(tmp_path, fresh_accelerate_state):
    from trainer.rl.rollout import make_rollout

    ctx, model, _ = ppo_engine(tmp_path)
    batch, scores, tok = prompt_batch(ctx, 4), [0.5, -1.0, 2.0, 0.25], ctx.tokenizer
    args = replace(ctx.stage_args, rollout_micro_batch_size=4, missing_eos_penalty=1.5)

    def sample(eos=tok.eos_token_id):
        torch.manual_seed(0)
        return make_rollout(Generator(model, rows=args.rollout_micro_batch_size),
                            batch["input_ids"], batch["attention_mask"], args, FixedScores(scores), eos,
                            tok.pad_token_id, value=True)

    p = batch["input_ids"].shape[1]
    eos = early_eos(sample, p)
    rollout = sample(eos)
    assert rollout.scores.tolist() == pytest.approx(expected_after_penalty(rollout.input_ids, p, eos, scores, 1.5))


# ---------------------------------------------------------------- PPO: sampling temperature, entropy bonus


def test_a_ppo_step_at_a_temperature_starts_its_update_at_ratio_one(tmp_path, fresh_accelerate_state):
    """`rl_step` sampling at T 0.7 scores its update at 0.7 too: the one minibatch of a one-epoch step sees
    its old log-probs again before it steps - ratio 1, approx KL 0, nothing clipped. Scored at 1 instead,
    every token's log-ratio is the gap between the two temperatures' log-probs."""
    from trainer.rl.algorithms.ppo import PPO
    from trainer.rl.online import rl_step
    from trainer.rl.settings import make_scorer

    ctx, model, engine = ppo_engine(tmp_path, "--temperature", "0.7", "--min_new_tokens", "6")
    args, tok = replace(ctx.stage_args, rollout_batch_size=4, mini_batch_size=4, ppo_epochs=1), ctx.tokenizer
    assert args.temperature == 0.7
    algorithm = PPO(args)
    state = algorithm.start(ctx.plan.micro_batch_size, 0)
    torch.manual_seed(0)
    result = rl_step(engine, Generator(engine.raw, rows=args.rollout_micro_batch_size),
                     prompt_batch(ctx, 4), algorithm, state, make_scorer(args, tok), tok.eos_token_id,
                     tok.pad_token_id)
    assert result.finite and result.stepped
    assert result.metrics["val/ratio"] == pytest.approx(1.0, abs=1e-5)
    assert result.metrics["policy/approxkl_avg"] < 1e-10
    assert result.metrics["policy/clipfrac_avg"] == 0.0


def own_entropy(model, input_ids, attention_mask, prompt_length: int, adapter: str, temperature: float) -> torch.Tensor:
    """(B, R) entropy of `adapter`'s full softmax at `temperature` before each response token, from this test's
    own forward."""
    with torch.no_grad():
        logits = model.logits(input_ids, attention_mask, adapter)[:, prompt_length - 1 : -1].double() / temperature
    logp = logits.log_softmax(-1)
    return -(logp.exp() * logp).sum(-1)


def test_ppo_entropy_bonus_is_the_mean_entropy_of_the_response_tokens_only(tmp_path, fresh_accelerate_state):
    """With --entropy_coef 0.5 and responses of different lengths (one ends at its third token), the loss's
    entropy term and `policy/entropy_avg` are the mean of the policy's entropy at T 0.7 over the response
    tokens, none of the padding after an EOS: in the loss of the whole rollout, and in the update's
    minibatch of two micro-batches."""
    from trainer.rl.algorithms.ppo import PPO, micro_loss
    from trainer.rl.online import rl_update
    from trainer.rl.rollout import make_rollout

    ctx, model, engine = ppo_engine(tmp_path, "--entropy_coef", "0.5", "--temperature", "0.7")
    with torch.no_grad():  # logits of a trained model's size: entropies that differ from token to token
        model.causal_lm.get_output_embeddings().weight.mul_(40)
    batch, tok = prompt_batch(ctx, 4), ctx.tokenizer
    args = replace(ctx.stage_args, rollout_micro_batch_size=4, mini_batch_size=4, ppo_epochs=1)

    def sample(eos=tok.eos_token_id):
        torch.manual_seed(0)
        return make_rollout(Generator(model, rows=args.rollout_micro_batch_size),
                            batch["input_ids"], batch["attention_mask"], args,
                            FixedScores([0.5, -1.0, 2.0, 0.25]), eos, tok.pad_token_id, value=True)

    p = batch["input_ids"].shape[1]
    rollout = sample(early_eos(sample, p))
    mask = rollout.response_mask
    assert mask.sum(1).min() == 3 and mask.sum(1).max() == args.max_new_tokens  # padding inside the update's width
    entropy = own_entropy(model, rollout.input_ids, rollout.attention_mask, p, "policy", 0.7)
    expected = float((entropy * mask).sum() / mask.sum())
    assert abs(expected - float(entropy.mean())) > 1e-3  # the padding's entropy would move the mean

    algorithm = PPO(args)
    state = algorithm.start(micro_batch_size=2, seed=0)
    adv = algorithm.advantages(rollout, state)
    engine.model.train()
    loss, stats = micro_loss(engine.model, rollout, adv.advantages, adv.returns, args, 0.7)
    assert float(stats["policy/entropy_avg"]) == pytest.approx(expected, rel=1e-5)
    bonus = float(loss.detach()) - float(stats["loss/policy_avg"]) - args.vf_coef * float(stats["loss/value_avg"])
    assert bonus == pytest.approx(-0.5 * expected, rel=1e-4)
    stats, finite, stepped = rl_update(engine, algorithm, rollout, adv, state, 0.7)
    assert finite and stepped
    assert stats["policy/entropy_avg"] == pytest.approx(expected, rel=1e-5)


def grpo_context(tmp_path, *extra):
    from foundation.settings import GRPOArguments
    from trainer.engine.harness import Engine
    from trainer.engine.setup import start_run
    from trainer.grpo import build_model

    ctx = start_run(GRPOArguments, ["--config", str(TINY_GRPO), "--output_dir", str(tmp_path / "run"),
                                    "--rollout_batch_size", "2", "--mini_batch_size", "8", *extra])
    model = build_model(ctx)
    perturb(model, "policy")
    return ctx, model, Engine(model, ctx.train_args, ctx.accelerator, "grpo")


def test_grpo_rollout_subtracts_the_missing_eos_penalty_from_responses_without_eos(tmp_path, fresh_accelerate_state):
    from trainer.rl.rollout import make_rollout

    ctx, model, _ = grpo_context(tmp_path, "--missing_eos_penalty", "1.5")
    batch, tok = prompt_batch(ctx, 2), ctx.tokenizer
    scores = [0.5, -1.0, 2.0, 0.25, 1.0, 3.0, -0.5, 0.0]

    def sample(eos=tok.eos_token_id):
        torch.manual_seed(0)
        return make_rollout(Generator(model, rows=ctx.plan.rollout_micro_batch_size),
                            batch["input_ids"], batch["attention_mask"], ctx.stage_args, FixedScores(scores),
                            eos, tok.pad_token_id, group=ctx.stage_args.num_generations, nan_unscored=True)

    p = batch["input_ids"].shape[1]
    eos = early_eos(sample, p)
    rollout = sample(eos)
    assert rollout.scores.tolist() == pytest.approx(expected_after_penalty(rollout.input_ids, p, eos, scores, 1.5))


# ---------------------------------------------------------------- GRPO / RLOO


def group_rollout_of(scores, logprobs=None, ref_logprobs=None):
    from trainer.rl.rollout import Rollout

    rows = len(scores)
    logprobs = torch.zeros(rows, 2) if logprobs is None else torch.tensor(logprobs)
    return Rollout(input_ids=torch.zeros(rows, 4, dtype=torch.long), attention_mask=torch.ones(rows, 4),
                   response_mask=torch.ones(rows, 2), prompt_length=2, logprobs=logprobs,
                   ref_logprobs=None if ref_logprobs is None else torch.tensor(ref_logprobs), values=None,
                   scores=torch.tensor(scores), ended=torch.ones(rows, dtype=torch.bool),
                   entropy=torch.zeros(rows, 2), group=4)


def rollout_advantages(rollout, args):
    """(advantages, rewards) of GRPO's or RLOO's maths (`args.advantage`)."""
    from trainer.rl.algorithms.grpo import GRPO
    from trainer.rl.algorithms.rloo import RLOO

    algorithm = (RLOO if args.advantage == "rloo" else GRPO)(SimpleNamespace(epochs=1, **vars(args)))
    adv = algorithm.advantages(rollout, algorithm.start(1, 0))
    return adv.advantages, adv.rewards


def test_grpo_advantages_are_group_z_scores_with_a_std_other_than_one():
    """GRPO's advantage is (r - group mean) / (group std + 1e-4), the std unbiased: groups whose std is
    2.94 and 1.73 (a std of 1 would hide a missing division); with scale_rewards false only the mean goes."""
    scores = [1.0, 3.0, 4.0, 8.0, 2.0, 2.0, 5.0, 5.0]
    expected, centred = [], []
    for group in (scores[:4], scores[4:]):
        mean, var = mean_and_var(group)
        assert abs(math.sqrt(var) - 1) > 0.5
        expected += [(r - mean) / (math.sqrt(var) + 1e-4) for r in group]
        centred += [r - mean for r in group]
    args = SimpleNamespace(advantage="grpo", beta=0.04, num_generations=4, scale_rewards=True)
    advantages, rewards = rollout_advantages(group_rollout_of(scores), args)
    assert advantages.tolist() == pytest.approx(expected, rel=1e-6)
    assert rewards.tolist() == scores
    advantages, _ = rollout_advantages(group_rollout_of(scores), replace_ns(args, scale_rewards=False))
    assert advantages.tolist() == pytest.approx(centred, rel=1e-6)


def replace_ns(ns: SimpleNamespace, **changes) -> SimpleNamespace:
    return SimpleNamespace(**{**vars(ns), **changes})


def test_rloo_advantages_take_the_kl_off_the_reward_then_the_other_responses_mean():
    """RLOO: r - beta * (summed k1 KL of the response), then minus the mean of the group's other rewards."""
    scores = [1.0, 3.0, 4.0, 8.0]
    logp = [[-1.0, -2.0], [-0.5, -0.5], [-3.0, -1.0], [-0.2, -0.1]]
    ref = [[-1.5, -1.0], [-0.5, -0.9], [-2.0, -2.0], [-0.2, -0.4]]
    beta = 0.5
    rewards = [s - beta * sum(a - b for a, b in zip(lp, rf)) for s, lp, rf in zip(scores, logp, ref)]
    expected = [r - (sum(rewards) - r) / 3 for r in rewards]
    args = SimpleNamespace(advantage="rloo", beta=beta, num_generations=4, scale_rewards=True)
    advantages, got_rewards = rollout_advantages(group_rollout_of(scores, logp, ref), args)
    assert got_rewards.tolist() == pytest.approx(rewards, rel=1e-6, abs=1e-6)
    assert advantages.tolist() == pytest.approx(expected, rel=1e-6, abs=1e-6)


def grpo_one_step(tmp_path, scores, *extra):
    """One GRPO step (2 prompts x 4 responses, all full length, one optimizer step) scored `scores`:
    (the step's metrics, the scorer with what it saw, the model)."""
    from trainer.engine.phases import watching
    from trainer.rl.algorithms.grpo import GRPO
    from trainer.rl.online import rl_step

    ctx, model, engine = grpo_context(tmp_path, "--min_new_tokens", "6", "--learning_rate", "0.002", *extra)
    args, tok = ctx.stage_args, ctx.tokenizer
    scorer = FixedScores(scores, reference=args.beta > 0)
    algorithm = GRPO(args)
    state = algorithm.start(ctx.plan.micro_batch_size, 0)
    torch.manual_seed(0)
    with watching(engine.recorder.phase):
        result = rl_step(engine, Generator(engine.raw, rows=args.rollout_micro_batch_size),
                         prompt_batch(ctx, 2), algorithm, state, scorer, tok.eos_token_id, tok.pad_token_id)
    assert result.finite and result.stepped
    assert scorer.seen["response_mask"].sum() == 8 * args.max_new_tokens
    return result.metrics, scorer, model


def test_one_grpo_step_raises_positive_advantage_responses_and_lowers_negative_ones(tmp_path, fresh_accelerate_state):
    """Responses scored above their group's mean gain log-probability in one step, those below lose it."""
    scores = [1.0, 0.0, 0.0, 1.0, 0.0, 2.0, 0.0, 2.0]
    _, scorer, model = grpo_one_step(tmp_path, scores, "--beta", "0")
    seen = scorer.seen
    model.eval()
    moved = own_logprobs(model, seen["input_ids"], seen["attention_mask"], seen["prompt_length"], "policy")
    moved = moved - seen["policy"]
    above = torch.tensor([1, 0, 0, 1, 0, 1, 0, 1], dtype=torch.bool)
    assert moved[above].mean() > 0 > moved[~above].mean(), moved


def test_grpo_loss_adds_beta_times_the_k3_kl_to_the_reference(tmp_path, fresh_accelerate_state):
    """Equal scores give advantage 0, so GRPO's loss is beta times the k3 KL alone: the step's reported
    loss and kl_term equal the hand-computed mean of k3 = exp(ref - logp) - 1 - (ref - logp) over the
    response tokens, and the step pulls the policy towards the reference."""
    beta = 0.5
    metrics, scorer, model = grpo_one_step(tmp_path, [1.0] * 8, "--beta", str(beta))
    seen = scorer.seen
    k3 = [hand_kl(lp, rf, "k3") for lp, rf in zip(seen["policy"].flatten().tolist(),
                                                   seen["reference"].flatten().tolist())]
    mean_k3 = sum(k3) / len(k3)
    assert mean_k3 > 1e-3  # the policy really differs from its reference
    assert metrics["kl_term"] == pytest.approx(mean_k3, rel=1e-3)
    assert metrics["loss"] == pytest.approx(beta * mean_k3, rel=1e-3)
    model.eval()
    after = own_logprobs(model, seen["input_ids"], seen["attention_mask"], seen["prompt_length"], "policy")
    k1_before = float((seen["policy"] - seen["reference"]).pow(2).mean())
    k1_after = float((after - seen["reference"]).pow(2).mean())
    assert k1_after < k1_before


# ---------------------------------------------------------------- DPO


def pair_examples(eos: int) -> list:
    """Three pairs of random token ids, completions of different lengths, each ending in EOS."""
    from trainer.data.tokenization import PairExample

    g = torch.Generator().manual_seed(11)

    def ids(n):
        return torch.randint(100, 2000, (n,), generator=g).tolist()

    return [PairExample(ids(p), ids(c) + [eos], ids(r) + [eos], "test")
            for p, c, r in ((5, 4, 2), (3, 2, 5), (6, 3, 3))]


def own_sequence_logprob(model, prompt: list[int], completion: list[int], adapter: str) -> float:
    ids = torch.tensor([prompt + completion])
    return float(own_logprobs(model, ids, torch.ones_like(ids), len(prompt), adapter).sum())


def dpo_model(tokenizer):
    from foundation.settings import ModelArguments
    from trainer.model.shared_base import build_shared_model, stage_specs

    args = ModelArguments(model_name_or_path="tiny-llama", lora_r=4, lora_alpha=8, lora_dropout=0.0)
    model = build_shared_model(args, stage_specs("dpo", {}), vocab_size=len(tokenizer))
    perturb(model, "policy")
    return model


@pytest.mark.parametrize("share_prompt", [False, True], ids=["two-rows-per-pair", "one-row-per-pair"])
def test_dpo_step_margin_loss_and_gradient_match_an_independent_chosen_minus_rejected(smol_tokenizer, share_prompt,
                                                                                     fresh_accelerate_state):
    """`dpo_terms` (the DPO step's and the held-out check's scoring) against each completion scored in a
    row of its own by this test: the policy's chosen and rejected log-probs, rewards beta * (policy -
    reference), loss -log sigmoid(beta * margin); the held-out margin and accuracy; and one gradient step on
    the loss widens the policy's chosen-minus-rejected log-prob gap."""
    from accelerate import Accelerator

    from trainer.data.collators import pair_collator
    from trainer.dpo import DPOArguments, dpo_terms, implicit_reward_accuracy

    model = dpo_model(smol_tokenizer)
    examples = pair_examples(smol_tokenizer.eos_token_id)
    collate = pair_collator(smol_tokenizer.pad_token_id, share_prompt, model)
    assert ("segments" in collate(examples)) == share_prompt
    args = DPOArguments(beta=0.5)
    model.eval()

    def scored(adapter):
        return ([own_sequence_logprob(model, e.prompt_ids, e.chosen_ids, adapter) for e in examples],
                [own_sequence_logprob(model, e.prompt_ids, e.rejected_ids, adapter) for e in examples])

    (pc, pr), (rc, rr) = scored("policy"), scored("reference")
    margins = [(a - b) - (c - d) for a, b, c, d in zip(pc, pr, rc, rr)]
    assert all(abs(m) > 1e-2 for m in margins)  # the policy is off its reference, pair by pair
    reward_c = [args.beta * (a - c) for a, c in zip(pc, rc)]
    reward_r = [args.beta * (b - d) for b, d in zip(pr, rr)]
    losses_by_hand = [math.log1p(math.exp(-args.beta * m)) for m in margins]  # -log sigmoid(beta * m)

    losses, got_c, got_r, got_pc, got_pr = dpo_terms(model, collate(examples), args)
    tolerance = dict(rel=1e-4, abs=1e-4)
    assert got_pc.tolist() == pytest.approx(pc, **tolerance) and got_pr.tolist() == pytest.approx(pr, **tolerance)
    assert got_c.tolist() == pytest.approx(reward_c, **tolerance)
    assert got_r.tolist() == pytest.approx(reward_r, **tolerance)
    assert losses.tolist() == pytest.approx(losses_by_hand, **tolerance)

    held_out = implicit_reward_accuracy(model, examples, collate, args, 2, Accelerator(cpu=True), progress=False)
    reward_margins = [a - b for a, b in zip(reward_c, reward_r)]
    assert held_out["rewards/margins"] == pytest.approx(sum(reward_margins) / 3, **tolerance)
    assert held_out["rewards/accuracies"] == pytest.approx(sum(m > 0 for m in reward_margins) / 3)

    losses.mean().backward()
    with torch.no_grad():
        for q in model.trainable_parameters():
            if q.grad is not None:
                q.sub_(0.05 * q.grad)
    pc_after, pr_after = scored("policy")
    gap_before = sum(a - b for a, b in zip(pc, pr))
    assert sum(a - b for a, b in zip(pc_after, pr_after)) > gap_before


def test_a_mixed_precision_rollout_starts_the_update_at_ratio_one(tmp_path, fresh_accelerate_state):
    """With --mixed_precision bf16 the update's passes run under autocast (fp32 LoRA weights multiplied in
    bf16); the rollout's sampling and scoring passes run under the same autocast, so the one minibatch of a
    one-epoch GRPO step sees its old log-probs again before it steps: ratio 1, nothing clipped (outside
    autocast the LoRA products were fp32 and the first ratios moved by up to a few percent)."""
    metrics, _, model = grpo_one_step(tmp_path, [1.0, 0.0, 0.0, 1.0, 0.0, 2.0, 0.0, 2.0], "--beta", "0",
                                      "--mixed_precision", "bf16", "--dtype", "bfloat16")
    assert model.causal_lm.dtype == torch.bfloat16
    assert {p.dtype for p in model.trainable_parameters()} == {torch.float32}
    assert metrics["clip_ratio"] == 0.0
    assert metrics["ratio"] == pytest.approx(1.0, abs=1e-4)  # 1.0019 with the rollout outside autocast
