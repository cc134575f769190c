"""Rollout decoding: the prompt once through the model (prefill), then one token per step from a KV cache.

Each step's logits give the sampled token and, from the same logits, its log-prob and entropy at the sampling
temperature: the full softmax of the upcast logits divided by the temperature, before min-length, top-k and
top-p masks, which is what a scoring pass of the policy gives (`trainer.rl.scoring`). Rows that reached EOS
emit pad; whether every row has ended is read on the host once every `CHECK_EVERY` steps, never per token.

Paths (`--decode`): `eager` grows a KV cache by one position a step and runs each step eagerly; `compiled`
allocates the KV cache once at its full length and compiles the step (torch.compile; on CUDA in
"reduce-overhead" mode, so each token replays CUDA graphs; its decoder layers as one nested compile region,
compiled once for all of them). The compiled step and its cache are kept per model and batch size, so later
rollouts replay what the first captured: the LoRA weights are updated in place by the optimizer, and the
graphs read them where they are.

Weights (`--generation_weights`): a 4-bit base is frozen, so its linear weights can be dequantized once
(bitsandbytes' `dequantize_4bit`, the very values its training forward multiplies by) and each step reads
one dense matrix per layer instead of dequantizing it again: `dequantized` builds that copy for each
rollout and frees it after, `resident` keeps it, `quantized` decodes from the 4-bit weights (bitsandbytes'
own 4-bit matmul, which picks its fused kernels for a few rows). Under the run's mixed precision the LoRA
products likewise multiply copies of the adapter's weights in the autocast dtype, made once per decode
(`lora_compute_copies`), not cast again at every step, and a dense copy holds the adapter's LoRA-A weights
as extra rows: one matmul per layer and token gives the base output and the LoRA-A products. Sibling layers that
always multiply the same input (`SHARED_INPUT`: q/k/v, gate/up) are copied into one matrix, which the compiled
step multiplies once for all of them (`SharedProducts`): four matmuls per decoder layer where there were seven.
"""

from __future__ import annotations

import logging
import time
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, fields, replace
from types import FunctionType, MethodType
from typing import Iterator, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import nn
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from transformers.cache_utils import StaticLayer

from foundation.cli import UsageError
from foundation.settings import DECODE_CHOICES, DECODE_PATHS, GENERATION_WEIGHTS  # noqa: F401  (declared once)
from foundation.stages import POLICY
from profiling import resolve
from profiling.decode import sync
from profiling.tensors import HELD_DECODE_LORA, HELD_GENERATION_WEIGHTS, HELD_KV_CACHE, HELD_SWAPPED_OUT
from trainer.model.attention import decode_attention, decoding_through_it

logger = logging.getLogger(__name__)

CHECK_EVERY = 8  # decode steps between two reads of "has every row ended?" on the host
CACHE_ROUND = 128  # a compiled path's KV cache length is rounded up to this: one graph serves many prompts
UNROLL_BELOW = 8  # inductor's own unroll_reductions_threshold: sums shorter than this become pointwise code
# Sibling layers that multiply the same input, by the names transformers gives them (Llama, Mistral, Qwen2/3, Gemma)
SHARED_INPUT = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


@dataclass(frozen=True)
class Sampling:
    """How responses are sampled. temperature 0 is greedy decoding (log-probs then at temperature 1)."""

    max_new_tokens: int = 32
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    decode: str = "eager"  # DECODE_CHOICES (auto: settled where it decodes, `check_path`)
    generation_weights: str = "quantized"  # GENERATION_WEIGHTS ("auto": quantized, where no planner chose)

    @classmethod
    def of(cls, args) -> "Sampling":
        """The sampling fields of a settings object (`trainer.rl.settings.RolloutArguments`)."""
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})

    @property
    def scoring_temperature(self) -> float:
        """The temperature log-probs are taken at: the one sampled with (1 for greedy decoding)."""
        return self.temperature or 1.0


@dataclass
class Decoded:
    """What one decode gives: R is the steps run (max_new_tokens, or fewer when every row ended sooner)."""

    tokens: torch.Tensor  # (B, R) sampled tokens; pad after each row's EOS
    logprobs: torch.Tensor  # (B, R) fp32 log-prob of each token at the sampling temperature (full softmax)
    entropy: torch.Tensor  # (B, R) fp32 entropy of each step's distribution at that temperature
    ended: torch.Tensor  # (B,) bool: the row emitted EOS


def pick_tokens(logits: torch.Tensor, sampling: Sampling, eos_id: int, bar_eos: Union[bool, torch.Tensor]
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(B,) tokens drawn from (B, V) logits, and their (B,) log-probs and entropies at the scoring temperature.

    The draw sees EOS barred (before `min_new_tokens`; a 0-dim bool tensor in a decode's steps, so that one
    compiled step serves the steps on both sides of it), then temperature, top-k and top-p, as transformers'
    processors apply them; the log-prob and entropy see none of the masks. Drawn as a race, argmax of
    log p - log Exp(1) (a draw from p), so the step stays on the device; greedy at temperature 0. Three
    (B, V) fp32 buffers at most beside the logits, four while the entropy is summed."""
    scaled = logits.to(torch.float32, copy=True)  # upcast, then divided: as the chunked head does
    if sampling.scoring_temperature != 1.0:
        scaled.div_(sampling.scoring_temperature)
    logp = scaled.log_softmax(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    masked = scaled  # from here on the draw's scores, masked in place
    if isinstance(bar_eos, torch.Tensor):
        masked[:, eos_id].masked_fill_(bar_eos, float("-inf"))
    elif bar_eos:
        masked[:, eos_id] = float("-inf")
    if sampling.temperature:
        masked = truncated(masked, sampling.top_k, sampling.top_p)
        masked.sub_(torch.empty_like(masked).exponential_().log_())
    tokens = masked.argmax(-1)
    return tokens, logp.gather(-1, tokens[:, None])[:, 0], entropy


def truncated(scores: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """(B, V) scores, in place, with the tokens outside the top `top_k` (0: all) and then outside the smallest
    set of probability >= `top_p` set to -inf; at least one token stays."""
    if top_k and top_k < scores.shape[-1]:
        kth = scores.topk(top_k, dim=-1).values[:, -1:]
        scores.masked_fill_(scores < kth, float("-inf"))
    if top_p < 1.0:
        ascending, order = scores.sort(dim=-1)
        dropped = ascending.softmax(-1).cumsum(-1) <= 1 - top_p
        dropped[:, -1] = False
        scores.masked_fill_(dropped.scatter(-1, order, dropped), float("-inf"))
    return scores


def check_path(decode: str, device_type: str = "cpu", embedding_on_host: bool = False) -> str:
    """The path to decode on: the one given, or auto settled by `profiling.resolve.decode_path`'s rule (a run
    settles auto at its start; this serves models driven from code)."""
    if decode not in DECODE_CHOICES:
        raise UsageError(f"--decode {decode!r}: must be one of {', '.join(DECODE_CHOICES)}")
    return resolve.decode_path(decode, device_type, offload_embeddings=embedding_on_host)


_REGIONS: dict[object, object] = {}  # a decoder layer class (its forward), `_layer_with_cache` -> marked as a region


def layer_regions(causal_lm: nn.Module, on: bool) -> int:
    """Mark (`on`) or unmark every decoder layer's forward for a compiled decode (`_layer_step`): each layer as one
    nested compile region (`torch.compiler.nested_compile_region`), so the compiled step compiles one layer and
    stamps its code out for the others instead of compiling each anew. Outside a compile the mark is a no-op. A
    layer compiled for training (--compile_layers) is marked in its no-grad forward, the one a decode runs; a
    layer whose forward is replaced otherwise keeps it; where torch has no such regions nothing is marked.
    Returns how many layers are marked."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    from trainer.model.compiled import CompiledLayer

    region = getattr(torch.compiler, "nested_compile_region", None)
    marked = 0
    for layer in causal_lm.modules():
        if not isinstance(layer, GradientCheckpointingLayer):
            continue
        cls, own = type(layer), vars(layer).get("forward")
        mark = on and region is not None
        if mark and cls not in _REGIONS:
            _REGIONS[cls] = region(cls.forward)
            _REGIONS.setdefault(_layer_with_cache, region(_layer_with_cache))
        if isinstance(own, CompiledLayer):
            own.eager = _layer_step if mark else cls.forward
            marked += mark
            continue
        ours = isinstance(own, MethodType) and own.__func__ is _layer_step
        if mark and (own is None or ours):
            layer.forward = MethodType(_layer_step, layer)
            marked += 1
        elif not on and ours:
            del layer.forward
    return marked


def _layer_step(layer, hidden_states, *args, **kwargs):
    """A decoder layer's forward in a decode. Compiled, it is a region: where the layer's attention writes the
    step into its static cache itself (`_static_cache_of`), one whose inputs are tensors only, which torch traces
    once for every layer (`_layer_with_cache`); else the layer's own forward, traced per layer and compiled
    once. Not compiled, the layer's own forward."""
    own = type(layer).forward
    if not torch.compiler.is_compiling():
        return own(layer, hidden_states, *args, **kwargs)
    cache = None if args else _static_cache_of(layer, kwargs)
    if cache is None:
        return _REGIONS[type(layer)](layer, hidden_states, *args, **kwargs)
    cos, sin = kwargs["position_embeddings"]
    return _REGIONS[_layer_with_cache](layer, hidden_states, kwargs.get("attention_mask"), kwargs.get("position_ids"),
                                       cos, sin, kwargs.get("cache_position"), *cache)


def _static_cache_of(layer, kwargs: dict) -> Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(keys, values, tokens held) of the static cache layer a decoder layer's call writes to, where its attention
    (`trainer.model.attention.single_token_gqa`, the decode's implementation) can write the step itself: a
    transformers `StaticLayer` (no sliding window) already filled by the prompt, and no argument the region
    would not pass on; else None."""
    index = getattr(getattr(layer, "self_attn", None), "layer_idx", None)
    if (index is None or kwargs.get("position_embeddings") is None or not decoding_through_it()
            or not _known_arguments(tuple(kwargs))):
        return None
    layers = getattr(kwargs.get("past_key_values"), "layers", None)
    entry = layers[index] if isinstance(layers, list) and index < len(layers) else None
    if type(entry) is not StaticLayer or not entry.is_initialized:
        return None
    return entry.keys, entry.values, entry.cumulative_length


_LAYER_ARGUMENTS = {"attention_mask", "position_ids", "past_key_values", "use_cache", "cache_position",
                    "position_embeddings"}


@torch.compiler.assume_constant_result
def _known_arguments(names: tuple[str, ...]) -> bool:
    """Whether a decoder layer's call passes only keywords the region passes on. Settled while tracing, as the
    call's keywords are, rather than traced per layer (a set built and compared in bytecode)."""
    return set(names) <= _LAYER_ARGUMENTS


def _layer_with_cache(layer, hidden_states, attention_mask, position_ids, cos, sin, cache_position, keys, values,
                      held):
    """The layer's own forward with no cache object: its attention writes the step into `keys` and `values`
    after the `held` tokens (`decode_kv`), as the cache's update would."""
    return type(layer).forward(layer, hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                               past_key_values=None, use_cache=False, cache_position=cache_position,
                               position_embeddings=(cos, sin), decode_kv=(keys, values, held))


class _Compiled:
    """A model's compiled decode step and one full-length KV cache per batch size, reset between rollouts and
    kept between them (the estimator prices it in every phase): prompt + new tokens rounded up to CACHE_ROUND,
    grown only when a longer rollout comes. `regions`: its decoder layers compiled as one reused region
    (`layer_regions`), else the step is compiled whole."""

    def __init__(self, causal_lm, regions: bool = True):
        import torch._inductor

        mode = "reduce-overhead" if next(causal_lm.parameters()).device.type == "cuda" else None
        self.regions = layer_regions(causal_lm, regions)
        # a LoRA-B product is a rank-wide sum (`_times_lora_b`): unrolled into the kernel reading it
        ranks = [a.weight.shape[0] for m in causal_lm.modules() for a in getattr(m, "lora_A", {}).values()]
        options = {**(torch._inductor.list_mode_options(mode) if mode else {}),
                   "unroll_reductions_threshold": max([UNROLL_BELOW, *(r + 1 for r in ranks)]),
                   "post_grad_custom_pre_pass": SharedProducts()}
        self.step = torch.compile(_own_copy(_step), options=options, fullgraph=False)
        self.caches: dict[int, tuple[int, object]] = {}
        setattr(causal_lm, HELD_KV_CACHE, self)  # a memory record counts the caches as kv_cache in every phase

    def __iter__(self) -> Iterator[torch.Tensor]:
        """The kept caches' key and value tensors."""
        for _, cache in self.caches.values():
            for layer in getattr(cache, "layers", ()):
                yield from (t for t in (getattr(layer, "keys", None), getattr(layer, "values", None))
                            if isinstance(t, torch.Tensor))

    def describe(self) -> str:
        return (f"{self.regions} decoder layers compiled as one reused region" if self.regions
                else "the step compiled whole")

    def rows_for(self, batch: int) -> int:
        """The batch size to decode `batch` rows at: the smallest one with a cache already that holds them (its
        compiled step and its cache serve them), else `batch` itself."""
        return min((rows for rows in self.caches if rows >= batch), default=batch)

    def cache(self, causal_lm, batch: int, length: int):
        from transformers import StaticCache

        held = self.caches.get(batch)
        if held is None or held[0] < length:
            length = -(-length // CACHE_ROUND) * CACHE_ROUND
            self.caches[batch] = held = (length, StaticCache(config=causal_lm.config, max_cache_len=length))
        else:
            held[1].reset()
        return held


_COMPILED: "weakref.WeakKeyDictionary[torch.nn.Module, _Compiled]" = weakref.WeakKeyDictionary()


def _own_copy(function: FunctionType) -> FunctionType:
    """`function` with a code object of its own. torch.compile keeps the frames it compiled on the code object:
    every compiled step made from the one `_step` (a model each, or compiled anew) would add to one list of
    them, and past dynamo's recompile limit (8) a step runs eagerly, with one warning."""
    return FunctionType(function.__code__.replace(), function.__globals__, function.__name__,
                        function.__defaults__, function.__closure__)


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


def compile_errors() -> tuple[type, ...]:
    """What torch.compile raises when it cannot compile (dynamo's errors; inductor's where torch has one)."""
    import torch._dynamo.exc

    errors: tuple[type, ...] = (torch._dynamo.exc.TorchDynamoException,)
    try:
        from torch._inductor.exc import InductorError
    except ImportError:
        return errors
    return errors + (InductorError,)


def compile_anew(causal_lm: nn.Module, regions: bool = True) -> None:
    """From the next compiled decode on, compile the model's step anew (fresh caches too), its decoder layers as
    one reused region or the step whole: the fallback when the regions do not compile, and the decode
    benchmark's comparison of the two."""
    _COMPILED[causal_lm] = _Compiled(causal_lm, regions=regions)


def _step(causal_lm, tokens, positions, cache_position, mask, cache, sampling: Sampling, eos_id: int,
          bar_eos: Union[bool, torch.Tensor]):
    """One decode step: the last tokens through the model, the next ones picked from its logits."""
    logits = causal_lm(input_ids=tokens, attention_mask=mask, position_ids=positions, past_key_values=cache,
                       cache_position=cache_position, use_cache=True).logits[:, -1]
    return pick_tokens(logits, sampling, eos_id, bar_eos)


class DequantizedLinear(nn.Module):
    """A bitsandbytes 4-bit linear layer as one dense matrix in its compute dtype: `dequantize_4bit` of its
    weight, multiplied as its own forward multiplies a batch of tokens (input cast to the compute dtype,
    output back to the input's), so the same values come out.

    `lora_rank` > 0 leaves that many rows under the matrix for the LoRA-A weights of the adapter a decode
    multiplies (`lora_compute_copies` fills them): while `rows_for` names that adapter one matmul gives the
    base output and the LoRA-A products side by side, the last `lora_rank` columns, where a separate small
    matmul would launch for each (a split-K GEMM and its reduction on a GPU, per layer and token).

    `shared`: (matrix, bias or None, first row) of a sibling group's one matrix (`SHARED_INPUT`), which this
    copy's rows are a slice of. Compiled, the copy multiplies the whole of it and keeps its own columns, which
    `SharedProducts` turns into one matmul for the group; eager, it multiplies its own rows."""

    def __init__(self, layer: nn.Module, lora_rank: int = 0, shared: Optional[tuple] = None):
        import bitsandbytes.functional as bnbf

        super().__init__()
        state = layer.weight.quant_state
        dtype = layer.compute_dtype or state.dtype
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
        state, first = group[0].weight.quant_state, group[0]
        rows = [m.weight.quant_state.shape[0] + ranks[m] for m in group]
        kwargs = dict(dtype=first.compute_dtype or state.dtype, device=first.weight.device)
        matrix = torch.empty(sum(rows), state.shape[1], **kwargs)
        bias = None if first.bias is None else torch.empty(sum(rows), **kwargs)
        for member, start in zip(group, [sum(rows[:i]) for i in range(len(rows))]):
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
            if len({(m.weight.quant_state.shape[1], m.compute_dtype or m.weight.quant_state.dtype, m.weight.device,
                     m.bias is None) for m in members}) == 1:
                groups.append(members)
    return groups


def _four_bit_layers(causal_lm: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    """(parent, attribute, layer) of every bitsandbytes 4-bit linear layer of the model."""
    try:
        from bitsandbytes.nn import Linear4bit
    except ImportError:
        return []
    return [(parent, name, child) for parent in causal_lm.modules() for name, child in parent.named_children()
            if isinstance(child, Linear4bit)]


_RESIDENT: "weakref.WeakKeyDictionary[nn.Module, list]" = weakref.WeakKeyDictionary()
_SWAPPED: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()  # models decoding from a copy now
_said: set[str] = set()


@contextmanager
def generation_weights(causal_lm: nn.Module, choice: str, adapter: str = POLICY) -> Iterator[None]:
    """The body decodes from dense copies of the 4-bit layers, swapped in place of each layer and swapped back
    after, also on errors (`dequantized`: made here and freed after, their blocks left in the allocator's cache
    for the next rollout's copy, so a compiled step's CUDA graphs read the addresses they were recorded with;
    `resident`: made once, kept, and served to either choice after). `quantized` (or "auto" left unplanned)
    changes nothing. Nested in an outer one (a rollout's generate phase holding one copy for all its chunks),
    it changes nothing either. A model with no 4-bit layer has nothing to copy: said once. Under autocast in
    the layers' compute dtype each copy has rows for `adapter`'s LoRA-A weights (`DequantizedLinear`, filled
    by `lora_compute_copies`)."""
    if causal_lm in _SWAPPED or choice in ("quantized", "auto"):
        yield
        return
    swaps = _RESIDENT.get(causal_lm)
    if swaps is None:  # the layers are looked for only when copies are made, not at every rollout
        layers = _four_bit_layers(causal_lm)
        if not layers:
            if choice not in _said:
                _said.add(choice)
                logger.info("generation_weights %s: the model has no 4-bit layer to dequantize; decoding as it is",
                            choice)
            yield
            return
        swaps = _dense_copies(causal_lm, layers, adapter)
        if choice == "resident":
            _RESIDENT[causal_lm] = swaps
        else:
            _say_if_moved(causal_lm, [copy.weight for *_, copy in swaps])
    setattr(causal_lm, HELD_GENERATION_WEIGHTS, [copy.weight for *_, copy in swaps])
    setattr(causal_lm, HELD_SWAPPED_OUT, [layer for _, _, layer, _ in swaps])  # a memory record still counts them
    for parent, name, _, copy in swaps:
        setattr(parent, name, copy)
    _SWAPPED.add(causal_lm)
    try:
        yield
    finally:
        _SWAPPED.discard(causal_lm)
        for parent, name, layer, _ in swaps:
            setattr(parent, name, layer)
        setattr(causal_lm, HELD_SWAPPED_OUT, [])
        kept = _RESIDENT.get(causal_lm)  # a per-rollout copy goes now; a kept one stays counted
        held = [copy.weight for *_, copy in kept] if kept else []
        setattr(causal_lm, HELD_GENERATION_WEIGHTS, held)


_PLACES: "weakref.WeakKeyDictionary[nn.Module, tuple[int, ...]]" = weakref.WeakKeyDictionary()


def _say_if_moved(causal_lm: nn.Module, copies: list[torch.Tensor]) -> None:
    """On CUDA, say when a per-rollout copy lies elsewhere than the model's last one: a compiled decode step's
    CUDA graphs read the weights where they were recorded, so torch records them anew for the moved copy (its
    cost falls in this rollout's generate time)."""
    places, last = tuple(t.data_ptr() for t in copies), _PLACES.get(causal_lm)
    _PLACES[causal_lm] = places
    if last is not None and places != last and copies[0].device.type == "cuda" and causal_lm in _COMPILED:
        logger.info("generation_weights dequantized: %d of %d dense copies lie elsewhere than in the last rollout; "
                    "the compiled decode step records its CUDA graphs anew",
                    sum(a != b for a, b in zip(places, last)), len(places))


def _rows_for(parent: nn.Module, layer: nn.Module, adapter: str) -> int:
    """The LoRA-A rows a dense copy of `layer` makes room for: `adapter`'s rank where `parent` is its LoRA layer
    and its products are made in the copy's dtype (autocast, the weights' fp32 being cast to it), else none."""
    if getattr(parent, "base_layer", None) is not layer or adapter not in getattr(parent, "lora_A", {}):
        return 0
    lora_a = parent.lora_A[adapter]
    if not _dense(lora_a.weight):
        return 0
    device = lora_a.weight.device.type
    dtype = layer.compute_dtype or layer.weight.quant_state.dtype
    on = torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) == dtype != lora_a.weight.dtype
    return lora_a.weight.shape[0] if on else 0


def drop_resident_weights(causal_lm: nn.Module) -> None:
    """Free a model's resident dense copies (the next `resident` decode makes them again)."""
    _RESIDENT.pop(causal_lm, None)
    setattr(causal_lm, HELD_GENERATION_WEIGHTS, [])


_LORA_COPIES: "weakref.WeakKeyDictionary[nn.Module, dict]" = weakref.WeakKeyDictionary()
COPIES_IN_USE = "decode_lora_copies"  # a LoRA layer's __dict__ entry while a decode multiplies copies: (A or None, B)


def _dense(weight: torch.Tensor) -> bool:
    """A whole weight on this process: not a ZeRO-3 partition or a DTensor shard."""
    return type(weight.data) is torch.Tensor and weight.numel() > 0 and not hasattr(weight, "ds_id")


@contextmanager
def lora_compute_copies(model, adapter: str, device_type: str, keep: bool) -> Iterator[None]:
    """The body's LoRA products of `adapter` multiply copies of its weights in the autocast dtype the rollout
    computes in (bf16 under mixed precision), cast once per decode where autocast would cast the fp32 weights
    at every step (two small kernels per LoRA layer and step); the LoRA-A copy holds the weights times the
    adapter's scaling, so no step scales the products (a kernel per LoRA layer and step; the same values where
    the scaling is a power of two, alpha/r's usual case, else to the copy's rounding). `keep` (a compiled
    step, whose CUDA graphs read fixed addresses): made once per model, adapter and dtype and refreshed in
    place; else made here and freed after. A dense copy of the base layer with room for it holds the A copy in its rows
    (`DequantizedLinear`), none of its own. Meanwhile those LoRA layers run `_copies_forward` in place of the
    routed one. Without autocast, with weights in its dtype already, or where peft's own layers add the LoRA
    outputs (a model that cannot route: `trainer.model.routing`), nothing changes."""
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
    held = _LORA_COPIES.setdefault(model, {}) if keep else {}
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
    _list_copies(model, () if keep else copies)
    try:
        yield
    finally:
        for layer, forward, room in zip(layers, routed, rows):
            del layer.__dict__[COPIES_IN_USE]
            layer.forward = forward
            if room is not None:
                layer.base_layer.rows_for = None
        if not keep:
            _list_copies(model)


def _copies_forward(layer, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """A LoRA layer's forward while a decode multiplies its adapter's copies (`lora_compute_copies`): the base
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
    the rank-wide sum it is, which inductor unrolls into the kernel that reads the result (`_Compiled` lets it
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


def _list_copies(model, passing: Sequence[tuple] = ()) -> None:
    """Name the LoRA copies alive - the kept ones, and `passing` while a decode holds them - where the memory
    recorder counts them (as generation_weights)."""
    kept = [pair for pairs in _LORA_COPIES.get(model, {}).values() for pair in pairs]
    setattr(model.causal_lm, HELD_DECODE_LORA, [t for pair in (*kept, *passing) for t in pair if t is not None])


@torch.no_grad()
def decode(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, sampling: Sampling, eos_id: int,
           pad_id: int, adapter: str = POLICY) -> Decoded:
    """Sample up to `sampling.max_new_tokens` tokens after each left-padded prompt under `adapter`, in eval mode
    (no dropout); the train mode and active adapter are restored after."""
    device = prompt_ids.device
    on_host = model.causal_lm.get_input_embeddings().weight.device != device
    sampling = replace(sampling, decode=check_path(sampling.decode, device.type, on_host))
    was_training = model.training
    model.eval()
    try:
        with model.use_adapter(adapter), generation_weights(model.causal_lm, sampling.generation_weights, adapter), \
                lora_compute_copies(model, adapter, device.type, keep=sampling.decode == "compiled"), \
                decode_attention(model.causal_lm):
            try:
                return _decode(model.causal_lm, prompt_ids, prompt_mask, sampling, eos_id, pad_id)
            except compile_errors() as exc:
                held = _COMPILED.get(model.causal_lm)
                if sampling.decode != "compiled" or held is None or not held.regions:
                    raise
                logger.warning("decode compiled: the decoder layers did not compile as one reused region (%s: %s); "
                               "compiling the step whole", type(exc).__name__, " ".join(str(exc).split())[:200])
                compile_anew(model.causal_lm, regions=False)
                return _decode(model.causal_lm, prompt_ids, prompt_mask, sampling, eos_id, pad_id)
    finally:
        model.train(was_training)


def _decode(causal_lm, prompt_ids, prompt_mask, sampling: Sampling, eos_id: int, pad_id: int) -> Decoded:
    from transformers import DynamicCache

    batch, prompt_length = prompt_ids.shape
    new, device = sampling.max_new_tokens, prompt_ids.device
    first_call, started = False, time.perf_counter()
    live = batch  # rows asked for; a compiled step's batch may add rows that start as ended
    if sampling.decode == "compiled":
        compiled = _COMPILED.get(causal_lm) or _COMPILED.setdefault(causal_lm, _Compiled(causal_lm))
        batch = compiled.rows_for(batch)
        if batch > live:  # fewer rows than a compiled batch (a last chunk, an evaluation): no new graph or cache
            prompt_ids = torch.cat([prompt_ids, prompt_ids[:1].expand(batch - live, -1)])
            prompt_mask = torch.cat([prompt_mask, prompt_mask[:1].expand(batch - live, -1)])
        first_call = batch not in compiled.caches
        length, cache = compiled.cache(causal_lm, batch, prompt_length + new)
        step = compiled.step
    else:
        length, cache, step = prompt_length + new, DynamicCache(config=causal_lm.config), _step
    mask = torch.ones(batch, length, dtype=prompt_mask.dtype, device=device)
    mask[:, :prompt_length] = prompt_mask
    positions = (prompt_mask.long().cumsum(-1) - 1).clamp(min=0)
    cache_position = torch.arange(prompt_length, device=device)
    logits = causal_lm(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=positions,
                       past_key_values=cache, cache_position=cache_position, use_cache=True,
                       logits_to_keep=1).logits[:, -1]
    # EOS barred before min_new_tokens: a tensor, so that a compiled step compiles once for both sides of it
    barred, free = ((torch.ones((), dtype=torch.bool, device=device), torch.zeros((), dtype=torch.bool, device=device))
                    if sampling.min_new_tokens > 0 else (False, False))
    tokens, logprobs, entropy = pick_tokens(logits, sampling, eos_id, barred)
    out = Decoded(torch.full((batch, new), pad_id, dtype=torch.long, device=device),
                  torch.zeros(batch, new, device=device), torch.zeros(batch, new, device=device),
                  torch.arange(batch, device=device) >= live)
    positions = positions[:, -1:] + 1
    cache_position = cache_position[-1:] + 1
    steps = new
    for t in range(new):
        tokens = tokens.masked_fill(out.ended, pad_id)
        out.tokens[:, t], out.logprobs[:, t], out.entropy[:, t] = tokens, logprobs, entropy
        out.ended |= tokens == eos_id
        if t + 1 == new or ((t + 1) % CHECK_EVERY == 0 and bool(out.ended.all())):
            steps = t + 1
            break
        step_mask = mask if sampling.decode == "compiled" else mask[:, :prompt_length + t + 1]
        if sampling.decode == "compiled" and device.type == "cuda":
            torch.compiler.cudagraph_mark_step_begin()  # this step's inputs are copies: the last replay's may go
        tokens, logprobs, entropy = step(causal_lm, tokens[:, None], positions, cache_position, step_mask, cache,
                                         sampling, eos_id, barred if t + 1 < sampling.min_new_tokens else free)
        positions, cache_position = positions + 1, cache_position + 1
    if first_call:
        sync(device)
        logger.info("decode compiled for %d rows (%s): the first decode took %.1f s, compilation%s included "
                    "(once per batch size)", batch, compiled.describe(), time.perf_counter() - started,
                    " and CUDA graph capture" if device.type == "cuda" else "")
    return Decoded(out.tokens[:live, :steps], out.logprobs[:live, :steps], out.entropy[:live, :steps],
                   out.ended[:live])
