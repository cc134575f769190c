"""How a response is scored under an adapter - log-probs at a temperature, per-token values, one score
per sequence - for the rollout, the PPO update and every evaluation alike.

Rows are a (left-padded) prompt followed by a right-padded response whose `width` tokens are the
last columns. The output at position t predicts token t+1, so the response's tokens are scored from
the last width+1 positions, minus the final one; only those positions' hidden states go through the LM
head, a chunk at a time, so no (tokens x vocabulary) tensor exists, forward or backward.
"""

from __future__ import annotations

from typing import Optional

import torch

from foundation.stages import POLICY, REFERENCE, REWARD, VALUE
from trainer.losses import last_token_values
from trainer.model.logprobs import entropy_from_logits, token_logprobs


def trimmed_to_longest_response(input_ids: torch.Tensor, attention_mask: torch.Tensor, response_mask: torch.Tensor
                                ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(input_ids, attention_mask, width) without the trailing response columns no row uses - they cost
    compute and nothing else: `width` is the longest response's length (the update's micro-batches)."""
    width = int(response_mask.sum(1).max().item())
    keep = input_ids.shape[1] - response_mask.shape[1] + width
    return input_ids[:, :keep], attention_mask[:, :keep], width


def response_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, width: int, adapter: str,
                      temperature: float = 1.0, with_entropy: bool = False
                      ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(B, width) log-probs of the response tokens under `adapter`'s full softmax at `temperature`
    (the distribution sampling used, before any top-k / top-p truncation), and their entropy if asked."""
    out = model(input_ids, attention_mask, adapter=adapter, output=_unwrapped(model).lm_output, keep_last=width + 1)
    return logprobs_of(model, out, input_ids, temperature, with_entropy)


def logprobs_of(model, out: torch.Tensor, input_ids: torch.Tensor, temperature: float = 1.0,
                with_entropy: bool = False) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """`response_logprobs` from a pass's `lm_output` over the last width + 1 positions: hidden states
    through the LM head in chunks (no (tokens x vocabulary) tensor), or logits where the model has no
    plain head."""
    out = out[:, :-1]
    tokens = input_ids[:, -out.shape[1]:]
    raw = _unwrapped(model)
    if raw.lm_output == "hidden":
        return raw.token_logprobs_of(out, tokens, temperature, with_entropy)
    return next_token_logprobs(out, tokens, temperature, with_entropy)


def _unwrapped(model):
    return getattr(model, "module", model)  # DDP and DeepSpeed hold the model as .module


def next_token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0,
                        with_entropy: bool = False) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(B, T) log-probs of `tokens` under the (B, T, V) `logits` that predict them, at `temperature`, and
    the entropy of each position's distribution if asked. At a temperature the logits are upcast before the
    division, as the chunked head does (`head_logprobs`): dividing bf16 logits rounds them a second time."""
    if temperature not in (0.0, 1.0):
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    return token_logprobs(logits, tokens), entropy_from_logits(logits) if with_entropy else None


def policy_and_values(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, width: int,
                      temperature: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log-probs, entropy, values) of the response under `policy` and `value`, from one routed pass of
    the base: the PPO update's forward. `model` may be wrapped (DDP)."""
    out, scores = model(input_ids, attention_mask, adapter=(POLICY, VALUE),
                        output=(_unwrapped(model).lm_output, "scores"), keep_last=width + 1)
    logprobs, entropy = logprobs_of(model, out, input_ids, temperature, with_entropy=True)
    return logprobs, entropy, scores[:, :-1]


def rollout_scores(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, response_mask: torch.Tensor,
                   temperature: float, *, reference: bool, value: bool,
                   reward_adapter: Optional[str]) -> tuple[Optional[torch.Tensor], ...]:
    """(reference log-probs, values, reward scores) of a rollout's rows from ONE routed pass of the base
    over the adapters asked for: PPO's and GRPO's scoring pass (the policy's log-probs come from sampling). What is not asked for is None: the reference when there is no KL term,
    the value without a critic, the reward when it is scripted."""
    width = response_mask.shape[1]
    asked = ((REFERENCE, model.lm_output, reference), (VALUE, "scores", value),
             (reward_adapter, "scores", reward_adapter is not None))
    groups = [(adapter, output) for adapter, output, wanted in asked if wanted]
    if not groups:
        return None, None, None
    adapters, outputs = zip(*groups)
    out = dict(zip(adapters, model.fused(input_ids, attention_mask, adapters, outputs, keep_last=width + 1)))
    ref_logprobs = logprobs_of(model, out[REFERENCE], input_ids, temperature)[0] if reference else None
    values = out[VALUE][:, :-1] if value else None
    scores = last_token_values(out[reward_adapter][:, 1:], response_mask).float() if reward_adapter is not None else None
    return ref_logprobs, values, scores


def sequence_scores(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, response_mask: torch.Tensor,
                    adapter: str = REWARD) -> torch.Tensor:
    """(B,) `adapter`'s head read at each row's last response token (a reward model's score)."""
    scores = model(input_ids, attention_mask, adapter=adapter, output="scores", keep_last=response_mask.shape[1])
    return last_token_values(scores, response_mask).float()
