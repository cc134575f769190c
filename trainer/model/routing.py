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

        So on a routable model, peft's own switches act on empty lists and `use_adapter` switches. (peft's
        `disable_adapter()` would set requires_grad on its active adapters - none here - when it ends, freezing
        every adapter.)"""
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
        one group of all rows for a single active adapter. None (nothing to add) while peft's adapters are
        disabled or merged, or where the layer holds none of the adapters asked for."""
        route = self._route
        if layer.disable_adapters or layer.merged or (route is None and self._single is None):
            return None
        if route is None:  # one adapter, all rows
            if self._single not in layer.lora_A:
                return None
            return _add_lora(layer, (self._single,), layer.scaling[self._single], x, output)
        if x.shape[0] != self._route_rows:
            raise ValueError(f"routed batch has {x.shape[0]} rows, the route {route} {self._route_rows}")
        names = tuple(name for name in self._route_names if name in layer.lora_A)
        if not names:
            return None
        if len(self._route_names) == 1:  # one group: a single adapter's pass
            return _add_lora(layer, names, layer.scaling[names[0]], x, output)
        scales = self._route_scales[(names, tuple(layer.scaling[n] for n in names), x.device)]
        return _add_lora(layer, names, scales, x, output, route)

    def _route_to(self, route: Route) -> None:
        if not self.routable:
            raise ValueError("this model's adapters cannot be routed per row group (only plain LoRA on linear "
                             "layers can): run the passes one adapter at a time")
        for name, rows in route:
            if name not in self.specs:
                raise KeyError(f"no adapter '{name}' on this model (have {self.adapter_names})")
        self._route = route
        self._route_names = tuple(dict.fromkeys(name for name, _ in route))
        self._route_rows = sum(rows for _, rows in route)
        if len(self._route_names) > 1:
            self._route_scales = self._scales_of(route)

    def _scales_of(self, route: Route) -> dict:
        """For each kind of LoRA layer (the route's adapters on it, their scalings, its device): the factor that
        scales each row's LoRA-A outputs, (rows, 1, ranks summed) - the group's scaling on its adapter's columns,
        0 on the others'. Made once per route and device and kept (a checkpointed backward routes again per layer)."""
        cached = (route, self._lora_params[0][0].device)
        kept = self._scales_by_route.get(cached)
        if kept is not None:
            return kept
        if len(self._scales_by_route) >= 16:  # routes differ by rows only: a few per run
            self._scales_by_route.clear()
        scales = self._scales_by_route[cached] = {}
        for layer in self._tuner_layers:
            names = tuple(name for name in self._route_names if name in layer.lora_A)
            if not names:
                continue
            device = layer.lora_A[names[0]].weight.device
            key = (names, tuple(layer.scaling[n] for n in names), device)
            if key in scales:
                continue
            columns, end = {}, 0  # each adapter's LoRA-A columns in the stacked product
            for name in names:
                columns[name] = slice(end, end + layer.lora_A[name].weight.shape[0])
                end = columns[name].stop
            table = torch.zeros(self._route_rows, 1, end)
            start = 0
            for name, rows in route:
                if name in columns:
                    table[start : start + rows, :, columns[name]] = layer.scaling[name]
                start += rows
            scales[key] = table.to(device)
        return scales

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
    its identity, and compiled layers would compile once per layer). A decode with copies of the adapter's
    weights runs its own (`trainer.model.decode_weights.DecodeWeights.lora_copies`)."""
    output = layer.base_layer(x, *args, **kwargs)
    added = layer.__dict__[ROUTER]._add_routed_lora(layer, x, output)
    return output if added is None else added


def _add_lora(layer, names: tuple[str, ...], scale, x: torch.Tensor, out: torch.Tensor,
              groups: Optional[Route] = None) -> torch.Tensor:
    """`out` (the base layer's output for rows `x`) plus the LoRA outputs of adapters `names`: one adapter's with
    its scaling (a number), or the row `groups`' adapters' from ONE pair of matmuls over their stacked weights,
    `scale` (rows, 1, ranks) keeping each row's own adapter's LoRA-A columns, scaled, and zeroing the rest: per
    layer the same few kernels for any number of groups, where a loop over groups launches them per group.
    Without autograd (scoring, decoding) added into `out` in place, no copy. Cast as peft's own layers cast
    (its bitsandbytes layers cast the LoRA output to the result's dtype before adding; the plain one adds in
    the wider dtype, then casts); the scaling multiplies the rank-wide products, not the output."""
    if groups is None:
        a, b = layer.lora_A[names[0]].weight, layer.lora_B[names[0]].weight
        x = _lora_input(layer, ((names[0], x.shape[0]),), x)
    else:
        a = torch.cat([layer.lora_A[n].weight for n in names])
        b = torch.cat([layer.lora_B[n].weight for n in names], dim=1)
        x = _lora_input(layer, groups, x)
    delta = F.linear(F.linear(x, a).mul_(scale), b)  # in place: a matmul keeps its input for backward, not its output
    if type(layer).__module__.endswith(".bnb"):
        delta = delta.to(out.dtype)
    return out.add_(delta) if not torch.is_grad_enabled() else (out + delta).to(out.dtype)


def _lora_input(layer, groups: Route, x: torch.Tensor) -> torch.Tensor:
    """What the LoRA-A matmul reads: `x`, through each group's own LoRA dropout where one is active (training
    with dropout), in the LoRA weights' dtype - or, under autocast without dropout, as it is (a cast to fp32
    and autocast's back would be two kernels and the same values)."""
    active = [name in layer.lora_dropout and not _inert(layer.lora_dropout[name]) for name, _ in groups]
    if not any(active) and _in_autocast_dtype(x):
        return x
    x = x.to(next(iter(layer.lora_A.values())).weight.dtype)
    if len(groups) == 1:
        return layer.lora_dropout[groups[0][0]](x)
    if not any(active):
        return x
    pieces = x.split([rows for _, rows in groups])
    return torch.cat([layer.lora_dropout[name](xs) if on else xs for (name, _), xs, on in zip(groups, pieces, active)])


def _inert(dropout: nn.Module) -> bool:
    return isinstance(dropout, nn.Identity) or not dropout.training


def _in_autocast_dtype(x: torch.Tensor) -> bool:
    """Whether autocast is on for `x`'s device and `x` is in its dtype already (what it casts a matmul's inputs to)."""
    kind = x.device.type
    return torch.is_autocast_enabled(kind) and x.dtype == torch.get_autocast_dtype(kind)
