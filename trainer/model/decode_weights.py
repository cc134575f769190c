"""What a rollout's decode multiplies (`trainer.model.decode`).

Weights (`--generation_weights`): a 4-bit base is frozen, so its linear weights can be dequantized once
(bitsandbytes' `dequantize_4bit`, the very values its training forward multiplies by) and each step reads
one dense matrix per layer instead of dequantizing it again: `dequantized` builds that copy for each
rollout and frees it after, `resident` keeps it, `quantized` decodes from the 4-bit weights (bitsandbytes'
own 4-bit matmul, which picks its fused kernels for a few rows). Under the run's mixed precision the LoRA
products likewise multiply copies of the adapter's weights in the autocast dtype, made once per decode
(`DecodeWeights.lora_copies`), not cast again at every step, and a dense copy holds the adapter's LoRA-A weights
as extra rows: one matmul per layer and token gives the base output and the LoRA-A products. Sibling layers that
always multiply the same input (`SHARED_INPUT`: q/k/v, gate/up) are copied into one matrix, which the compiled
step multiplies once for all of them (`SharedProducts`): four matmuls per decoder layer where there were seven.
"""

from __future__ import annotations

import logging
from itertools import accumulate
from contextlib import contextmanager
from types import MethodType
from typing import Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from foundation.stages import POLICY

logger = logging.getLogger(__name__)

# Sibling layers that multiply the same input, by the names transformers gives them (Llama, Mistral, Qwen2/3, Gemma)
SHARED_INPUT = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class DequantizedLinear(nn.Module):
    """A bitsandbytes 4-bit linear layer as one dense matrix in its compute dtype: `dequantize_4bit` of its
    weight, multiplied as its own forward multiplies a batch of tokens (input cast to the compute dtype,
    output back to the input's), so the same values come out.

    `lora_rank` > 0 leaves that many rows under the matrix for the LoRA-A weights of the adapter a decode
    multiplies (`DecodeWeights.lora_copies` fills them): while `rows_for` names that adapter one matmul gives the
    base output and the LoRA-A products side by side, the last `lora_rank` columns, where a separate small
    matmul would launch for each (a split-K GEMM and its reduction on a GPU, per layer and token).

    `shared`: (matrix, bias or None, first row) of a sibling group's one matrix (`SHARED_INPUT`), which this
    copy's rows are a slice of. Compiled, the copy multiplies the whole of it and keeps its own columns, which
    `SharedProducts` turns into one matmul for the group; eager, it multiplies its own rows."""

    def __init__(self, layer: nn.Module, lora_rank: int = 0, shared: Optional[tuple] = None):
        import bitsandbytes.functional as bnbf

        super().__init__()
        state = layer.weight.quant_state
        dtype = _compute_dtype(layer)
        (self.out_features, in_features), self.lora_rank, self.rows_for = state.shape, lora_rank, None
        self.dtype = dtype  # read in the forward as a constant, not from a tensor
        rows = self.out_features + lora_rank
        group, group_bias, self.first = shared or (None, None, 0)
        weight = (torch.empty(rows, in_features, dtype=dtype, device=layer.weight.device) if group is None
                  else group[self.first : self.first + rows])
        weight[self.out_features :].zero_()
        weight[: self.out_features] = bnbf.dequantize_4bit(layer.weight.data, state)  # its CPU ops have no out=
        # buffers, so that a compiled step reads them as inputs rather than baking them in
        self.register_buffer("weight", weight, persistent=False)
        self.register_buffer("group", group, persistent=False)
        bias = None if layer.bias is None else layer.bias.detach().to(dtype)
        rows_bias = None
        if group_bias is not None:
            rows_bias = group_bias[self.first : self.first + rows]
            rows_bias[self.out_features :].zero_()
            rows_bias[: self.out_features] = bias
        elif bias is not None and lora_rank:
            rows_bias = torch.cat([bias, bias.new_zeros(lora_rank)])
        self.register_buffer("bias", bias, persistent=False)
        self.register_buffer("group_bias", group_bias, persistent=False)
        self.register_buffer("rows_bias", rows_bias, persistent=False)

    @property
    def dense(self) -> torch.Tensor:
        """The dequantized matrix (without the LoRA rows)."""
        return self.weight[: self.out_features]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # with `rows_for` set, (..., out_features + lora_rank): `_copies_forward` splits them
        rows = self.out_features + (self.lora_rank if self.rows_for is not None else 0)
        if self.group is not None and torch.compiler.is_compiling():
            out = F.linear(x.to(self.dtype), self.group, self.group_bias)[..., self.first : self.first + rows]
        elif self.rows_for is not None:
            out = F.linear(x.to(self.dtype), self.weight, self.rows_bias)
        else:
            out = F.linear(x.to(self.dtype), self.dense, self.bias)
        return out.to(x.dtype)


def _dense_copies(causal_lm: nn.Module, layers: list[tuple[nn.Module, str, nn.Module]], adapter: str) -> list:
    """(parent, attribute, layer, its dense copy) for every 4-bit layer, each copy with rows for `adapter`'s
    LoRA-A where it takes them (`_rows_for`), the members of each sibling group (`SHARED_INPUT`: the same input
    dimension, compute dtype, device and bias or none) slices of one matrix."""
    ranks = {layer: _rows_for(parent, layer, adapter) for parent, _, layer in layers}
    shared: dict[nn.Module, tuple] = {}
    for group in _sibling_groups(causal_lm, ranks):
        lead = group[0]
        rows = [m.weight.quant_state.shape[0] + ranks[m] for m in group]
        kwargs = dict(dtype=_compute_dtype(lead), device=lead.weight.device)
        matrix = torch.empty(sum(rows), lead.weight.quant_state.shape[1], **kwargs)
        bias = None if lead.bias is None else torch.empty(sum(rows), **kwargs)
        for member, start in zip(group, accumulate([0, *rows[:-1]])):
            shared[member] = (matrix, bias, start)
    return [(parent, name, layer, DequantizedLinear(layer, ranks[layer], shared.get(layer)))
            for parent, name, layer in layers]


def _sibling_groups(causal_lm: nn.Module, four_bit: dict) -> list[list[nn.Module]]:
    """The 4-bit layers (keys of `four_bit`) that sit together under one module by the names of `SHARED_INPUT`,
    directly or as the base layers of LoRA layers, with the same input dimension, compute dtype, device and
    bias or none: each group's layers, in its names' order."""
    groups = []
    for module in causal_lm.modules():
        for names in SHARED_INPUT:
            children = [getattr(module, name, None) for name in names]
            members = [child if child in four_bit else getattr(child, "base_layer", None) for child in children]
            if not all(m in four_bit for m in members):
                continue
            if len({(m.weight.quant_state.shape[1], _compute_dtype(m), m.weight.device, m.bias is None)
                    for m in members}) == 1:
                groups.append(members)
    return groups


def _compute_dtype(layer: nn.Module) -> torch.dtype:
    """The dtype a bitsandbytes 4-bit layer multiplies in, which its dense copy holds."""
    return layer.compute_dtype or layer.weight.quant_state.dtype


def _four_bit_layers(causal_lm: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    """(parent, attribute, layer) of every bitsandbytes 4-bit linear layer of the model."""
    try:
        from bitsandbytes.nn import Linear4bit
    except ImportError:
        return []
    return [(parent, name, child) for parent in causal_lm.modules() for name, child in parent.named_children()
            if isinstance(child, Linear4bit)]


class DecodeWeights:
    """What a decode multiplies in place of a model's own weights, and what it keeps of them between decodes:
    the dense copies of the 4-bit layers (`--generation_weights`) and the LoRA compute copies. Owned by one
    `trainer.model.decode.Generator`; its `tensors` and `swapped_out` are what a memory record counts."""

    def __init__(self, causal_lm: nn.Module, choice: str):
        self.causal_lm, self.choice = causal_lm, choice
        self.resident: Optional[list] = None  # `resident`: the swaps, made once and kept
        self.swaps: list = []  # the swaps in place now
        self.lora: dict[tuple[str, torch.dtype], list] = {}  # (adapter, dtype) -> [A copy, B copy] kept per LoRA layer
        self.passing: list = []  # a per-decode LoRA copy's pairs while it runs
        self.said = False

    def tensors(self) -> list[torch.Tensor]:
        """The copies alive: the dense ones in place or kept, and the LoRA copies kept or held by a decode."""
        swaps = self.swaps or self.resident or []
        pairs = [*(pair for pairs in self.lora.values() for pair in pairs), *self.passing]
        return [copy.weight for *_, copy in swaps] + [t for pair in pairs for t in pair if t is not None]

    def swapped_out(self) -> list[nn.Module]:
        """The 4-bit layers the dense copies stand in for now: out of the module tree, still held."""
        return [layer for _, _, layer, _ in self.swaps]

    def release(self) -> None:
        """Free resident dense copies (the next `resident` decode makes them again)."""
        self.resident = None

    @contextmanager
    def dense(self, adapter: str = POLICY) -> Iterator[None]:
        """The body decodes from dense copies of the 4-bit layers, swapped in place of each layer and swapped back
        after, also on errors (`dequantized`: made here and freed after, their blocks left in the allocator's
        cache for the next rollout's copy, which lands where this one lay unless other tensors took them - then
        a compiled step's CUDA graphs are recorded anew, said in the log (`trainer.model.decode`); `resident`:
        made once and kept). `quantized` (or "auto" left unplanned) changes nothing; so does a body inside
        another (a rollout's generate phase holding one copy for all its chunks). A model with no 4-bit layer
        has nothing to copy: said once. Under autocast in the layers' compute dtype each copy has rows for
        `adapter`'s LoRA-A weights (`DequantizedLinear`, filled by `lora_copies`)."""
        if self.swaps or self.choice in ("quantized", "auto"):
            yield
            return
        swaps = self.resident
        if swaps is None:  # the layers are looked for only when copies are made, not at every rollout
            layers = _four_bit_layers(self.causal_lm)
            if not layers:
                if not self.said:
                    self.said = True
                    logger.info("generation_weights %s: the model has no 4-bit layer to dequantize; decoding as it "
                                "is", self.choice)
                yield
                return
            swaps = _dense_copies(self.causal_lm, layers, adapter)
            if self.choice == "resident":
                self.resident = swaps
        for parent, name, _, copy in swaps:
            setattr(parent, name, copy)
        self.swaps = swaps
        try:
            yield
        finally:
            self.swaps = []
            for parent, name, layer, _ in swaps:
                setattr(parent, name, layer)

    @contextmanager
    def lora_copies(self, model, adapter: str, device_type: str, keep: bool) -> Iterator[None]:
        """The body's LoRA products of `adapter` multiply copies of its weights in the autocast dtype the rollout
        computes in (bf16 under mixed precision), cast once per decode where autocast would cast the fp32
        weights at every step (two small kernels per LoRA layer and step); the LoRA-A copy holds the weights
        times the adapter's scaling, so no step scales the products (a kernel per LoRA layer and step; the same
        values where the scaling is a power of two, alpha/r's usual case, else to the copy's rounding). `keep`
        (a compiled step, whose CUDA graphs read fixed addresses): made once per adapter and dtype and
        refreshed in place; else made here and freed after. A dense copy of the base layer with room for it
        holds the A copy in its rows (`DequantizedLinear`), none of its own. Meanwhile those LoRA layers run
        `_copies_forward` in place of the routed one. Without autocast, with weights in its dtype already, or
        where peft's own layers add the LoRA outputs (a model that cannot route: `trainer.model.routing`),
        nothing changes."""
        if not torch.is_autocast_enabled(device_type) or not getattr(model, "routable", False):
            yield
            return
        dtype = torch.get_autocast_dtype(device_type)
        layers = [layer for layer in model.lora_layers if adapter in getattr(layer, "lora_A", {})
                  and layer.lora_A[adapter].weight.dtype != dtype and _dense(layer.lora_A[adapter].weight)]
        if not layers:
            yield
            return
        rows = [_rows_of(layer.base_layer, layer.lora_A[adapter].weight.shape[0], dtype) for layer in layers]
        held = self.lora if keep else {}
        copies = held.setdefault((adapter, dtype), [[None, None] for _ in layers])

        def refreshed(copy, source: torch.Tensor) -> torch.Tensor:
            if copy is None:
                copy = source.to(dtype)
                if keep:  # static inputs of the compiled step, as parameters are: its CUDA graphs read them in place
                    torch._dynamo.mark_static_address(copy)
            else:
                copy.copy_(source)
            return copy

        with torch.no_grad():
            for layer, pair, room in zip(layers, copies, rows):
                scaled_a = layer.lora_A[adapter].weight * layer.scaling[adapter]
                if room is not None:  # the dense copy holds A: no copy of its own
                    room.copy_(scaled_a)
                else:
                    pair[0] = refreshed(pair[0], scaled_a)
                pair[1] = refreshed(pair[1], layer.lora_B[adapter].weight)
        routed = [layer.__dict__.get("forward") for layer in layers]
        for layer, pair, room in zip(layers, copies, rows):
            layer.__dict__[COPIES_IN_USE] = (None if room is not None else pair[0], pair[1])
            layer.forward = MethodType(_copies_forward, layer)
            if room is not None:
                layer.base_layer.rows_for = adapter
        self.passing = [] if keep else copies
        try:
            yield
        finally:
            self.passing = []
            for layer, forward, room in zip(layers, routed, rows):
                del layer.__dict__[COPIES_IN_USE]
                layer.forward = forward
                if room is not None:
                    layer.base_layer.rows_for = None


def _rows_for(parent: nn.Module, layer: nn.Module, adapter: str) -> int:
    """The LoRA-A rows a dense copy of `layer` makes room for: `adapter`'s rank where `parent` is its LoRA layer
    and its products are made in the copy's dtype (autocast, the weights' fp32 being cast to it), else none."""
    if getattr(parent, "base_layer", None) is not layer or adapter not in getattr(parent, "lora_A", {}):
        return 0
    lora_a = parent.lora_A[adapter]
    if not _dense(lora_a.weight):
        return 0
    device = lora_a.weight.device.type
    dtype = _compute_dtype(layer)
    on = torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) == dtype != lora_a.weight.dtype
    return lora_a.weight.shape[0] if on else 0


COPIES_IN_USE = "decode_lora_copies"  # a LoRA layer's __dict__ entry while a decode multiplies copies: (A or None, B)


def _dense(weight: torch.Tensor) -> bool:
    """A whole weight on this process: not a ZeRO-3 partition or a DTensor shard."""
    return type(weight.data) is torch.Tensor and weight.numel() > 0 and not hasattr(weight, "ds_id")


def _copies_forward(layer, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """A LoRA layer's forward while a decode multiplies its adapter's copies (`DecodeWeights.lora_copies`): the base
    layer's output plus the adapter's LoRA output, none of the routed forward's checks, which the decode settled
    for all layers (one adapter active, eval mode: no dropout): what a compiled step traces per LoRA layer. The
    LoRA-A products come from the dense copy's rows, beside its output (`DequantizedLinear`), or from A's copy."""
    base = layer.base_layer
    a, b = layer.__dict__[COPIES_IN_USE]
    out = base(x, *args, **kwargs)
    if a is None:
        out, products = out.split([base.out_features, base.lora_rank], dim=-1)
    else:
        products = F.linear(x.to(a.dtype), a)
    return out + _times_lora_b(products, b).to(out.dtype)


def _times_lora_b(products: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """LoRA-A `products` (..., r) times the LoRA-B copy `b` (out, r). Being compiled (the compiled step), written as
    the rank-wide sum it is, which inductor unrolls into the kernel that reads the result (`CompiledStep` lets it
    unroll sums as long as a rank): no matmul of its own, where a GPU would launch a small GEMM per LoRA layer
    and token. The same bytes read; fp32 sums rounded once. Eager, a matmul."""
    if torch.compiler.is_compiling():
        return (products.unsqueeze(-2) * b).sum(-1)
    return F.linear(products, b)


def _rows_of(base: nn.Module, rank: int, dtype: torch.dtype):
    """The rows of a decode's dense copy `base` that can hold a rank-`rank` LoRA-A in `dtype`, or None."""
    if isinstance(base, DequantizedLinear) and base.lora_rank == rank and base.weight.dtype == dtype:
        return base.weight[base.out_features :]
    return None


class SharedProducts(CustomGraphPass):
    """An inductor graph pass: matmuls (mm, addmm) of the same input by the same matrix - through views and
    casts - computed once, their other uses reading that one. The compiled step's dense copies of sibling layers
    (`SHARED_INPUT`) each multiply their group's whole matrix and keep their own columns: one GEMM per group and
    token on a GPU, where a GEMM per layer would launch (fewer, larger matmuls read the same bytes)."""

    KEYED = ("aten.view.default", "aten._unsafe_view.default", "aten.reshape.default", "aten.permute.default",
             "aten.t.default", "aten._to_copy.default", "prims.convert_element_type.default")
    MATMULS = ("aten.mm.default", "aten.addmm.default")

    def __call__(self, graph: torch.fx.Graph) -> None:
        keys: dict[torch.fx.Node, tuple] = {}
        first: dict[tuple, torch.fx.Node] = {}

        def key(value):
            if isinstance(value, torch.fx.Node):
                return keys.get(value, value)
            if isinstance(value, (list, tuple)):
                return tuple(key(v) for v in value)
            if isinstance(value, dict):
                return tuple(sorted((k, key(v)) for k, v in value.items()))
            return value

        for node in list(graph.nodes):
            name = str(node.target) if node.op == "call_function" else ""
            if name not in self.KEYED + self.MATMULS:
                continue
            keys[node] = (str(node.target), key(node.args), key(node.kwargs))
            if name in self.MATMULS:
                if keys[node] in first:
                    node.replace_all_uses_with(first[keys[node]])
                    graph.erase_node(node)
                else:
                    first[keys[node]] = node

    def uuid(self) -> bytes:  # in inductor's cache key of the graphs compiled with it
        return get_hash_for_files((__file__,))
