"""Policies side by side on held-out prompts, on one shared base: PPO's periodic evaluation (the policy
against its SFT reference) and `trainer.compare` (SFT, PPO and DPO after the pipeline) both run this.

Each policy samples responses to the same prompts with the same sampling noise, the scorer (the reward
adapter and / or reward functions) scores them, and each policy's KL to the reference is estimated on its
own samples, at the sampling temperature: sum over response tokens of log pi(y_t) - log pi_ref(y_t).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from foundation.stages import POLICY, REFERENCE
from trainer.data.collators import PromptCollator
from trainer.data.tokenization import PromptExample
from trainer.rl.rewards import Scorer
from trainer.model.decode import Generator, Sampling
from trainer.rl.rollout import sample_responses
from trainer.rl.scoring import response_logprobs


@dataclass
class PolicySamples:
    """Per prompt, for one policy: the score, the KL to the reference, the response length (and text)."""

    scores: list[float] = field(default_factory=list)
    kl: list[float] = field(default_factory=list)
    lengths: list[float] = field(default_factory=list)
    responses: list[str] = field(default_factory=list)

    def summary(self, baseline: "PolicySamples") -> dict[str, float]:
        mine, base = torch.tensor(self.scores), torch.tensor(baseline.scores)
        wins = (mine > base).float() + 0.5 * (mine == base).float()
        return {"mean_score": mine.mean().item(), "std_score": mine.std().item() if mine.numel() > 1 else 0.0,
                "win_rate": wins.mean().item(), "kl": float(torch.tensor(self.kl).mean()),
                "mean_length": float(torch.tensor(self.lengths).mean()), "prompts": float(mine.numel())}


@torch.no_grad()
def sample_policies(generator: Generator, prompts: Sequence[PromptExample], policies: Sequence[str], reference: str,
                    scorer: Scorer, sampling: Sampling, eos_id: int, pad_id: int, batch_size: int, seed: int,
                    accelerator=None, tokenizer=None, progress: bool = True) -> dict[str, PolicySamples]:
    """Sample every policy on `prompts` with `generator` (this rank's share of them under `accelerator`, gathered
    after), scored on its model.

    Sampling noise is seeded per batch, the same for every policy, and forked from the caller's RNG so
    training draws the same numbers whether or not it evaluated. With a `tokenizer` the responses are
    decoded too (on one process).
    """
    from accelerate.utils import gather_object
    from tqdm.auto import tqdm

    model = generator.model
    rank, ranks = (accelerator.process_index, accelerator.num_processes) if accelerator is not None else (0, 1)
    device = accelerator.device if accelerator is not None else next(model.parameters()).device
    mine = list(prompts[rank::ranks])
    collate = PromptCollator(pad_id)
    results = {name: PolicySamples() for name in policies}
    was_training = model.training
    model.eval()
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        main = accelerator is None or accelerator.is_main_process
        for start in tqdm(range(0, len(mine), batch_size), desc="policies", leave=False, dynamic_ncols=True,
                          disable=not (progress and main)):
            examples = mine[start : start + batch_size]
            batch = collate(examples)
            ids, mask = batch["input_ids"].to(device), batch["attention_mask"].to(device)
            for name in policies:
                torch.manual_seed(seed + start)  # the same sampling noise for every policy
                full, att, rmask, _ = sample_responses(generator, ids, mask, sampling, eos_id, pad_id, adapter=name)
                width = rmask.shape[1]
                out = results[name]
                out.scores += scorer(model, full, att, ids.shape[1], rmask, examples).float().tolist()
                out.lengths += rmask.sum(1).float().tolist()
                if name == reference:
                    out.kl += [0.0] * full.shape[0]
                else:
                    own, _ = response_logprobs(model, full, att, width, name, sampling.scoring_temperature)
                    ref, _ = response_logprobs(model, full, att, width, reference, sampling.scoring_temperature)
                    out.kl += ((own - ref) * rmask).sum(1).tolist()
                if tokenizer is not None:
                    out.responses += tokenizer.batch_decode(full[:, ids.shape[1]:].masked_fill(rmask == 0, pad_id),
                                                            skip_special_tokens=True)
    model.train(was_training)
    if ranks > 1:
        for out in results.values():
            out.scores, out.kl, out.lengths = (gather_object(v) for v in (out.scores, out.kl, out.lengths))
    return results


def policy_vs_reference(generator: Generator, prompts: Sequence[PromptExample], args, scorer: Scorer, eos_id: int, pad_id: int,
                        accelerator, reference: str = REFERENCE, progress: bool = True) -> Optional[dict[str, float]]:
    """PPO's and GRPO's evaluation figures, `policy` against `reference` with the run's rollout settings
    (`args`: sampling, `eval_seed`; `generator.rows` rows a pass): both policies' scores, the policy's win rate and KL,
    response lengths."""
    if not prompts:
        return None
    samples = sample_policies(generator, prompts, [POLICY, reference], reference, scorer, Sampling.of(args), eos_id,
                              pad_id, generator.pass_rows(len(prompts)), args.eval_seed, accelerator, progress=progress)
    mine, base = samples[POLICY].summary(samples[reference]), samples[reference].summary(samples[reference])
    return {"score_policy": mine["mean_score"], "score_sft": base["mean_score"], "win_rate": mine["win_rate"],
            "kl": mine["kl"], "response_length_policy": mine["mean_length"],
            "response_length_sft": base["mean_length"], "prompts": mine["prompts"]}


@dataclass
class AnswerChecks:
    """Per held-out prompt: each check function's value (None: does not apply), the response length, the text."""

    values: dict[str, list[Optional[float]]]
    lengths: list[int] = field(default_factory=list)
    responses: list[str] = field(default_factory=list)


@torch.no_grad()
def check_answers(generator: Generator, prompts: Sequence[PromptExample], scorer: Scorer, tokenizer, max_new_tokens: int,
                  batch_size: int, adapter: str = POLICY, progress: bool = True) -> AnswerChecks:
    """Answer every prompt greedily under `adapter` and run each of the scorer's functions on the answers:
    `trainer.evaluate exact_match`'s loop (one process)."""
    from tqdm.auto import tqdm

    model = generator.model
    device = next(model.parameters()).device
    collate, sampling = PromptCollator(tokenizer.pad_token_id), Sampling(max_new_tokens=max_new_tokens, temperature=0)
    out = AnswerChecks({f.name: [] for f in scorer.functions})
    model.eval()
    for start in tqdm(range(0, len(prompts), batch_size), desc="answers", unit="batch", dynamic_ncols=True,
                      disable=not progress):
        examples = prompts[start : start + batch_size]
        batch = collate(examples)
        ids, mask = batch["input_ids"].to(device), batch["attention_mask"].to(device)
        full, att, rmask, _ = sample_responses(generator, ids, mask, sampling, tokenizer.eos_token_id,
                                               tokenizer.pad_token_id, adapter=adapter)
        for name, values in zip(out.values, scorer.function_values(full, att, ids.shape[1], rmask, examples)):
            out.values[name] += values
        out.lengths += rmask.sum(1).tolist()
        out.responses += tokenizer.batch_decode(full[:, ids.shape[1]:].masked_fill(rmask == 0, tokenizer.pad_token_id),
                                                skip_special_tokens=True)
    return out
