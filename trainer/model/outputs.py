"""What one pass of the shared base gives, one method per kind: logits, hidden states, head scores,
next-token log-probs of labels, and (chosen, rejected) per one-row preference pair.

`SharedBaseModel` takes this mixin. The log-prob methods run the LM head only where a label is set,
a chunk at a time (`trainer.model.logprobs`), so the (tokens x vocab) logits are never held whole.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from trainer.model.routing import Active


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions counted over real tokens only, as generation computes them for left-padded prompts.

    Scoring a left-padded rollout with plain 0..T-1 positions would give log-probs that differ from
    the sampling distribution; for right-padded rows this equals 0..T-1 on every real token.
    """
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


class Outputs:
    """The output half of `SharedBaseModel`: each output kind of a pass under one adapter (or a route)."""

    def logits(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, adapter: str,
               keep_last: int = 0) -> torch.Tensor:
        """(B, T, V) next-token logits under `adapter` (the last `keep_last` positions if > 0)."""
        if keep_last and self._plain_lm_head:
            return self.lm_head(self.hidden_states(input_ids, attention_mask, adapter, keep_last))
        with self.use_adapter(adapter):
            return self.peft(input_ids=input_ids, attention_mask=attention_mask,
                             position_ids=position_ids_from_mask(attention_mask), use_cache=False,
                             logits_to_keep=keep_last).logits

    def hidden_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, adapter: Active,
                      keep_last: int = 0) -> torch.Tensor:
        """(B, T, H) last hidden states under `adapter` (or a route), skipping the LM head (no vocab-sized tensor)."""
        with self.use_adapter(adapter):
            out = self.causal_lm.base_model(input_ids=input_ids, attention_mask=attention_mask,
                                            position_ids=position_ids_from_mask(attention_mask), use_cache=False)
            hidden = out.last_hidden_state
            return hidden[:, -keep_last:] if keep_last else hidden

    def scores(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, adapter: str,
               keep_last: int = 0) -> torch.Tensor:
        """(B, T) per-token scalars from `adapter` and its head (values, or rewards read at the last token)."""
        return self._head(adapter)(self.hidden_states(input_ids, attention_mask, adapter, keep_last))

    def label_logprobs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, adapter: str,
                       labels: Optional[torch.Tensor]) -> torch.Tensor:
        """(B, T-1) log p(labels[:, t+1] | tokens <= t) under `adapter`; 0 where the label is IGNORE_INDEX.

        Equal to `token_logprobs(*shift_for_next_token(logits, labels))` over the full logits, but the
        LM head and the fp32 log-softmax run only at labelled positions (most tokens are prompt: this
        skips most of the largest matmul), a chunk of them at a time (`head_logprobs`).
        """
        from trainer.model.logprobs import IGNORE_INDEX, shift_for_next_token, token_logprobs

        if labels is None:
            raise ValueError("label_logprobs needs labels")
        if labels.shape != input_ids.shape:
            raise ValueError(f"labels {tuple(labels.shape)} do not match input_ids {tuple(input_ids.shape)}")
        if not self._plain_lm_head:
            return token_logprobs(*shift_for_next_token(self.logits(input_ids, attention_mask, adapter), labels))
        targets = labels[:, 1:]
        keep = targets != IGNORE_INDEX
        hidden = self.hidden_states(input_ids, attention_mask, adapter)[:, :-1]
        picked = self.head_logprobs(hidden[keep], targets[keep])  # the N labelled positions only
        return torch.zeros(targets.shape, dtype=picked.dtype, device=picked.device).masked_scatter(keep, picked)

    # ---- one row per preference pair (trainer.model.pairs) ------------------------------------
    @property
    def shares_pair_prompts(self) -> bool:
        """Whether the attention implementation takes the custom mask of one-row pairs (SDPA, eager)."""
        from trainer.model.pairs import MASK_IMPLEMENTATIONS

        return (getattr(self.causal_lm.config, "_attn_implementation", None) in MASK_IMPLEMENTATIONS
                and self._plain_lm_head)

    def pair_scores(self, input_ids: torch.Tensor, segments: Optional[torch.Tensor],
                    adapter: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(chosen, rejected) head scores per pair, each read at its completion's last token (EOS)."""
        from trainer.model.pairs import CHOSEN, REJECTED, last_of

        head = self._head(adapter)
        hidden = self._pair_hidden(input_ids, segments, adapter)
        rows = torch.arange(input_ids.shape[0], device=input_ids.device)
        return head(hidden[rows, last_of(segments, CHOSEN)]), head(hidden[rows, last_of(segments, REJECTED)])

    def pair_logprobs(self, input_ids: torch.Tensor, segments: Optional[torch.Tensor], adapter: str,
                      labels: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(chosen, rejected) summed log-probs of each completion's `labels` per pair, the LM head run only
        at completion positions."""
        from trainer.model.logprobs import IGNORE_INDEX
        from trainer.model.pairs import CHOSEN, REJECTED, predicting_positions

        if labels is None:
            raise ValueError("pair_logprobs needs labels")
        hidden = self._pair_hidden(input_ids, segments, adapter)
        rows = torch.arange(input_ids.shape[0], device=input_ids.device)
        keep = labels != IGNORE_INDEX
        source = predicting_positions(segments)
        picked_hidden = hidden[rows[:, None].expand_as(source)[keep], source[keep]]  # (N, H) at N completion tokens
        picked = self.head_logprobs(picked_hidden, labels[keep])
        per_token = torch.zeros(labels.shape, dtype=picked.dtype, device=picked.device).masked_scatter(keep, picked)
        return (per_token * (segments == CHOSEN)).sum(dim=1), (per_token * (segments == REJECTED)).sum(dim=1)

    def _pair_hidden(self, input_ids: torch.Tensor, segments: Optional[torch.Tensor], adapter: str) -> torch.Tensor:
        """(B, T, H) hidden states of one row per pair (`segments` from `SharedPromptPairCollator`): the
        prompt runs once, each completion sees only the prompt and itself."""
        from trainer.model.pairs import pair_attention_mask, pair_positions

        if segments is None:
            raise ValueError("one-row pairs need segments (SharedPromptPairCollator)")
        if not self.shares_pair_prompts:
            raise ValueError("one-row pairs need SDPA or eager attention (a custom attention mask); "
                             f"this model uses {self.causal_lm.config._attn_implementation}")
        dtype = self.causal_lm.get_input_embeddings().weight.dtype
        if torch.is_autocast_enabled(input_ids.device.type):
            dtype = torch.get_autocast_dtype(input_ids.device.type)
        config = self.causal_lm.config
        additive = config._attn_implementation == "eager"
        mask = pair_attention_mask(segments, dtype, additive)
        window = getattr(config, "sliding_window", None)  # None where the model has none or leaves it off
        if window:  # a custom mask is taken as it is: the sliding layers' window must be in it
            windowed = pair_attention_mask(segments, dtype, additive, window)
            types = getattr(config, "layer_types", None)  # none: every layer slides (Mistral)
            mask = {kind: windowed if kind == "sliding_attention" else mask for kind in types} if types else windowed
        with self.use_adapter(adapter):
            return self.causal_lm.base_model(input_ids=input_ids, attention_mask=mask,
                                             position_ids=pair_positions(segments), use_cache=False).last_hidden_state

    # ---- heads ------------------------------------------------------------------------------------
    def _head(self, adapter: str) -> nn.Module:
        if adapter not in self.heads:
            raise KeyError(f"adapter '{adapter}' has no scalar head")
        return self.heads[adapter]

    def lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """(..., V) logits of (..., H) hidden states as ONE matrix product.

        The last k positions of a batch are a strided view; the LM head applied to it as it is (what
        transformers' `logits_to_keep` does) runs as a slower batched product against the (V x H) weight
        expanded per row when the head is frozen; a flat copy of the few kept positions avoids that.
        """
        flat = hidden.reshape(-1, hidden.shape[-1])  # a copy of the few kept positions when strided
        return self.causal_lm.get_output_embeddings()(flat).view(*hidden.shape[:-1], -1)

    def head_logprobs(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """(N,) log p(labels) of (N, H) hidden states through the LM head (`token_logprobs_of`, no entropy)."""
        return self.token_logprobs_of(hidden, labels)[0]

    def token_logprobs_of(self, hidden: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0,
                          with_entropy: bool = False) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(...,) log p(labels) of (..., H) hidden states through the LM head at `temperature`, and the entropy
        of each position's distribution if asked. A plain linear head (Llama's, not a PEFT, 4-bit or
        ZeRO-3-partitioned one) runs in chunks (trainer.model.logprobs.head_logprobs): neither the
        (positions x V) logits nor their gradient is held whole; any other head builds its logits."""
        from trainer.model.logprobs import entropy_from_logits, head_logprobs, token_logprobs

        head = self.causal_lm.get_output_embeddings()
        flat, flat_labels = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
        if self.chunked_head:
            out = head_logprobs(flat, head.weight, head.bias, flat_labels, temperature=temperature,
                                with_entropy=with_entropy)
            logprobs, entropy = out if with_entropy else (out, None)
        else:
            logits = head(flat).unsqueeze(0)
            if temperature != 1.0:  # upcast first, as the chunked head does
                logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
            logprobs = token_logprobs(logits, flat_labels.unsqueeze(0)).squeeze(0)
            entropy = entropy_from_logits(logits).squeeze(0) if with_entropy else None
        return logprobs.view(labels.shape), None if entropy is None else entropy.view(labels.shape)

    @property
    def lm_output(self) -> str:
        """What a scoring pass asks for to get log-probs: "hidden" (the head then runs in chunks,
        `token_logprobs_of`), or "logits" where they are not the LM head of the last hidden state."""
        return "hidden" if self._plain_lm_head else "logits"

    @property
    def chunked_head(self) -> bool:
        """Whether the LM head's log-probs come from the hidden states in chunks (`token_logprobs_of`)."""
        head = self.causal_lm.get_output_embeddings()
        return type(head) is nn.Linear and not hasattr(head.weight, "ds_id") and self._plain_lm_head

    @property
    def _plain_lm_head(self) -> bool:
        """Logits are lm_head(last hidden state), as in Llama; some families scale or soft-cap them after."""
        cfg = self.causal_lm.config
        return not any(getattr(cfg, k, None) for k in ("final_logit_softcapping", "logit_scale", "logits_scaling"))
