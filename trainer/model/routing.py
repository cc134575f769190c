"""Routed LoRA: each row group of ONE batch through its own adapter, so the base runs once for all groups.

On a model whose adapters are plain LoRA on linear layers, every LoRA layer's forward is replaced by one that
runs its base layer and adds the LoRA outputs itself: the active adapter's, or each group's adapter's in a routed batch (`Route`).
`fused` stacks the same rows once per adapter and scores them in one routed pass: in 4-bit, every
dequantization of the base is paid once instead of once per adapter. `SharedBaseModel` takes this mixin.
"""

from __future__ import annotations

import logging
from types import MethodType
from typing import Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)


# A LoRA layer attribute: adapter -> (A, B) weight copies in the compute dtype that no-grad passes multiply by
# instead (trainer.model.decode.lora_compute_copies holds them while a decode runs).
COMPUTE_COPIES = "lora_compute_copies"
ROUTER = "_routing_model"  # a LoRA layer's __dict__ entry: the model whose route its forward follows

# A routed batch: (adapter, rows) per group, in batch order. The groups' rows go through the base as
# ONE batch, each group through its own LoRA weights (`Routing.fused`).
Route = tuple[tuple[str, int], ...]
Active = Union[str, Route]


class Routing:
    """The routing half of `SharedBaseModel`: the LoRA layers' forward, routes, and the fused pass over row groups."""

    def _install_routing(self) -> bool:
        """Give every LoRA linear layer the forward that adds the LoRA outputs - of the active adapter, or of
        each group's adapter in a routed batch - instead of peft's. False for other layer kinds: there
        peft's layers add the active adapter's outputs and passes run one adapter at a time.

        So on a routable model, peft's own switches act on empty lists: `use_adapter` switches and
        `base_only` turns the adapters off. (peft's `disable_adapter()` would set requires_grad on its
        active adapters - none here - when it ends, freezing every adapter.)"""
        from peft.tuners.lora import LoraLayer

        plain = all(isinstance(m, LoraLayer) and isinstance(m.base_layer, nn.Linear)  # bnb Linear4bit is one
                    and not getattr(m, "lora_variant", {}) for m in self._tuner_layers)
        if plain:
            for layer in self._tuner_layers:
                layer._active_adapter = []  # what peft's set_adapter assigns (peft 0.21); the switching tests pin it
                # in the instance's __dict__: an nn.Module attribute would make this model a submodule of its layer
                layer.__dict__[ROUTER] = self
                layer.forward = MethodType(_routed_forward, layer)
        return plain

    def _add_routed_lora(self, layer, x: torch.Tensor, output: torch.Tensor) -> Optional[torch.Tensor]:
        """`output` is the base layer's; add to each group's rows the LoRA output of that group's adapter -
        one group of all rows for a single active adapter. None (nothing to add) in `base_only` or while
        peft's adapters are disabled or merged."""
        route = self._route
        if self._base_only or layer.disable_adapters or layer.merged or (route is None and self._single is None):
            return None
        if route is None:  # one adapter, all rows (every decode step): no split, no route to check
            return _with_lora(layer, self._single, x, output)
        if x.shape[0] != sum(rows for _, rows in route):
            raise ValueError(f"routed batch has {x.shape[0]} rows, the route {route} {sum(r for _, r in route)}")
        sizes, pieces = [rows for _, rows in route], []
        for (name, _), xs, out in zip(route, x.split(sizes), output.split(sizes)):
            added = _with_lora(layer, name, xs, out)
            pieces.append(out if added is None else added)
        return output if not torch.is_grad_enabled() else pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    def _route_to(self, route: Route) -> None:
        if not self.routable:
            raise ValueError("this model's adapters cannot be routed per row group (only plain LoRA on linear "
                             "layers can): run the passes one adapter at a time")
        for name, rows in route:
            if name not in self.specs:
                raise KeyError(f"no adapter '{name}' on this model (have {self.adapter_names})")
        self._route = route

    def fused(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, adapters: Sequence[str],
              outputs: Sequence[str], keep_last: int = 0) -> tuple[torch.Tensor, ...]:
        """The same rows under several adapters in ONE pass of the base.

        `outputs[g]` ("logits", "hidden" or "scores") is what `adapters[g]` gives; result g equals
        `self.logits`, `self.hidden_states` or `self.scores` of `adapters[g]` with the same `keep_last`. Where routing cannot
        run (`_route_blocker`), the passes run one after the other instead, with the same results, said once.
        """
        if len(adapters) != len(outputs) or not adapters:
            raise ValueError(f"one output per adapter: got {list(adapters)} and {list(outputs)}")
        for output in outputs:
            if output not in ("logits", "hidden", "scores"):
                raise ValueError(f"a fused pass gives logits, hidden or scores, not '{output}'")
        blocker = self._route_blocker(outputs)
        if blocker is not None:
            if blocker not in self._fallbacks_logged:
                self._fallbacks_logged.add(blocker)
                logger.info("adapters %s run one pass each instead of one routed pass: %s", ", ".join(adapters),
                            blocker)
            return self._separate_passes(input_ids, attention_mask, adapters, outputs, keep_last)
        rows, groups = input_ids.shape[0], len(adapters)
        route = tuple((adapter, rows) for adapter in adapters)
        hidden = self.hidden_states(input_ids.repeat(groups, 1), attention_mask.repeat(groups, 1), route, keep_last)
        results = []
        for adapter, output, part in zip(adapters, outputs, hidden.split(rows)):
            if output == "logits":
                results.append(self.lm_head(part))
            elif output == "hidden":
                results.append(part)
            else:
                if adapter not in self.heads:
                    raise KeyError(f"adapter '{adapter}' has no scalar head")
                results.append(self.heads[adapter](part))
        return tuple(results)

    def _route_blocker(self, outputs: Sequence[str]) -> Optional[str]:
        """Why a routed pass cannot give `outputs` on this model, or None. Launch modes never block it: the
        ones that partition the base (ZeRO-3, FSDP) refuse the stages with several adapters at start."""
        if not self.routable:
            return "its adapters are not plain LoRA on linear layers"
        if "logits" in outputs and not self._plain_lm_head:
            return "its logits are not the LM head of the last hidden state (soft-capped or scaled)"
        return None

    def _separate_passes(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, adapters: Sequence[str],
                         outputs: Sequence[str], keep_last: int = 0) -> tuple[torch.Tensor, ...]:
        """What `fused` gives, from one pass per adapter: where routing cannot run, and what tests compare with."""
        passes = {"logits": self.logits, "hidden": self.hidden_states, "scores": self.scores}
        return tuple(passes[o](input_ids, attention_mask, a, keep_last) for a, o in zip(adapters, outputs))


def _routed_forward(layer, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """A LoRA layer's forward: its base layer, then its model's `_add_routed_lora`. In place of peft's, which
    would add nothing (no active adapter) but still copy the 4-bit output and check its arguments, per layer and
    per decode step, where decoding is bound by such per-call work. One function bound to each layer, not an
    object per layer: torch.compile then traces every layer's call alike (an object per layer is guarded by
    its identity, and compiled layers would compile once per layer)."""
    output = layer.base_layer(x, *args, **kwargs)
    added = layer.__dict__[ROUTER]._add_routed_lora(layer, x, output)
    return output if added is None else added


def _with_lora(layer, name: str, x: torch.Tensor, out: torch.Tensor) -> Optional[torch.Tensor]:
    """`out` (the base layer's output for rows `x`) plus adapter `name`'s LoRA output; None where the layer has
    no such adapter. Without autograd (scoring, decoding) added into `out` in place, no copy. Rounded as
    peft's own layer rounds (its bitsandbytes layers cast the LoRA output to the result's dtype before
    adding; the plain one adds in the wider dtype, then casts), so a routed pass gives each group what a
    pass under its adapter gives."""
    if name not in layer.lora_A:
        return None
    copies = getattr(layer, COMPUTE_COPIES, None)
    pair = copies.get(name) if copies and not torch.is_grad_enabled() else None
    if pair is not None:  # a decode's copies in the autocast dtype: the products autocast would give, no casts
        a, b = pair
        delta = F.linear(F.linear(layer.lora_dropout[name](x.to(a.dtype)), a), b) * layer.scaling[name]
    else:
        lora_a, dropout = layer.lora_A[name], layer.lora_dropout[name]
        if not (_in_autocast_dtype(x) and (isinstance(dropout, nn.Identity) or not dropout.training)):
            x = x.to(lora_a.weight.dtype)  # under autocast a round trip to fp32 and back: two kernels, same values
        delta = layer.lora_B[name](lora_a(dropout(x))) * layer.scaling[name]
    if type(layer).__module__.endswith(".bnb"):
        delta = delta.to(out.dtype)
    return out.add_(delta) if not torch.is_grad_enabled() else (out + delta).to(out.dtype)


def _in_autocast_dtype(x: torch.Tensor) -> bool:
    """Whether autocast is on for `x`'s device and `x` is in its dtype already (what it casts a matmul's inputs to)."""
    kind = x.device.type
    return torch.is_autocast_enabled(kind) and x.dtype == torch.get_autocast_dtype(kind)
