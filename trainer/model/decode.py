"""Rollout decoding: the prompt once through the model (prefill), then one token per step from a KV cache.

Each step's logits give the sampled token and, from the same logits, its log-prob and entropy at the sampling
temperature: the full softmax of the upcast logits divided by the temperature, before min-length, top-k and
top-p masks, which is what a scoring pass of the policy gives (`trainer.rl.scoring`). Rows that reached EOS
emit pad; whether every row has ended is read on the host once every `CHECK_EVERY` steps, never per token, and
not before `min_new_tokens` (no row can end sooner).

Paths (`--decode`): `eager` grows a KV cache by one position a step and runs each step eagerly; `compiled`
allocates the KV cache once at its full length and compiles the step (torch.compile; on CUDA in
"reduce-overhead" mode, so each token replays CUDA graphs; its decoder layers as one nested compile region,
compiled once for all of them). The compiled step and its cache are kept per model and batch size, so later
rollouts replay what the first captured: the LoRA weights are updated in place by the optimizer, and the
graphs read them where they are.

What a step multiplies - dense copies of a 4-bit base, the LoRA weights in the compute dtype - is
`trainer.model.decode_weights`'s.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections import Counter
from dataclasses import dataclass, fields, replace
from types import FunctionType, MethodType
from typing import Iterator, Optional, Union

import torch
from torch import nn
from transformers.cache_utils import StaticLayer

from foundation.cli import UsageError
from foundation.settings import DECODE_CHOICES, DECODE_PATHS  # noqa: F401  (declared once)
from foundation.stages import POLICY
from profiling import resolve
from profiling.decode import sync
from profiling.tensors import HELD_GENERATION_WEIGHTS, HELD_KV_CACHE
from trainer.model.attention import decode_attention, decoding_through_it
from trainer.model.decode_weights import SharedProducts, generation_weights, lora_compute_copies

logger = logging.getLogger(__name__)

CHECK_EVERY = 8  # decode steps between two reads of "has every row ended?" on the host
CACHE_ROUND = 128  # a compiled path's KV cache length is rounded up to this: one graph serves many prompts
UNROLL_BELOW = 8  # inductor's own unroll_reductions_threshold: sums shorter than this become pointwise code


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
        # (batch size, adapter) -> where its decodes found the dense copies, since its cache was made
        self.placings: dict[tuple[int, str], set[tuple[int, ...]]] = {}
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

    def placing(self, causal_lm, batch: int, adapter: str) -> int:
        """0 where the dense copies the step reads (`generation_weights`) lie where an earlier decode of `batch`
        rows of `adapter` (whose LoRA copies it reads) found them since its cache was made, or there are none
        (the step's CUDA graphs recorded there are replayed), else how many placings those decodes have found,
        this one counted: a new one has its CUDA graphs recorded anew, which torch keeps beside the earlier
        ones."""
        places = tuple(w.data_ptr() for w in getattr(causal_lm, HELD_GENERATION_WEIGHTS, None) or ())
        seen = self.placings.setdefault((batch, adapter), set())
        new = bool(seen) and places not in seen
        seen.add(places)
        return len(seen) if new else 0

    def cache(self, causal_lm, batch: int, length: int):
        from transformers import StaticCache

        held = self.caches.get(batch)
        if held is None or held[0] < length:
            length = -(-length // CACHE_ROUND) * CACHE_ROUND
            self.caches[batch] = held = (length, StaticCache(config=causal_lm.config, max_cache_len=length))
            self.placings = {key: seen for key, seen in self.placings.items() if key[0] != batch}  # recorded anew
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


def _compiled_graphs() -> int:
    """The graphs torch.compile has compiled in this process."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def _graph_breaks() -> Counter:
    """The graph breaks dynamo has met in this process, by reason."""
    from torch._dynamo.utils import counters

    return Counter(counters["graph_break"])


def _step(causal_lm, tokens, positions, cache_position, mask, cache, sampling: Sampling, eos_id: int,
          bar_eos: Union[bool, torch.Tensor]):
    """One decode step: the last tokens through the model, the next ones picked from its logits."""
    logits = causal_lm(input_ids=tokens, attention_mask=mask, position_ids=positions, past_key_values=cache,
                       cache_position=cache_position, use_cache=True).logits[:, -1]
    return pick_tokens(logits, sampling, eos_id, bar_eos)


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
                return _decode(model.causal_lm, prompt_ids, prompt_mask, sampling, eos_id, pad_id, adapter)
            except compile_errors() as exc:
                held = _COMPILED.get(model.causal_lm)
                if sampling.decode != "compiled" or held is None or not held.regions:
                    raise
                logger.warning("decode compiled: the decoder layers did not compile as one reused region (%s: %s); "
                               "compiling the step whole", type(exc).__name__, " ".join(str(exc).split())[:200])
                compile_anew(model.causal_lm, regions=False)
                return _decode(model.causal_lm, prompt_ids, prompt_mask, sampling, eos_id, pad_id, adapter)
    finally:
        model.train(was_training)


def _decode(causal_lm, prompt_ids, prompt_mask, sampling: Sampling, eos_id: int, pad_id: int,
            adapter: str = POLICY) -> Decoded:
    from transformers import DynamicCache

    batch, prompt_length = prompt_ids.shape
    new, device = sampling.max_new_tokens, prompt_ids.device
    first_call, placing, started = False, 0, time.perf_counter()
    live = batch  # rows asked for; a compiled step's batch may add rows that start as ended
    if sampling.decode == "compiled":
        compiled = _COMPILED.get(causal_lm) or _COMPILED.setdefault(causal_lm, _Compiled(causal_lm))
        batch = compiled.rows_for(batch)
        if batch > live:  # fewer rows than a compiled batch (a last chunk, an evaluation): no new graph or cache
            prompt_ids = torch.cat([prompt_ids, prompt_ids[:1].expand(batch - live, -1)])
            prompt_mask = torch.cat([prompt_mask, prompt_mask[:1].expand(batch - live, -1)])
        first_call = batch not in compiled.caches
        breaks = (_compiled_graphs(), _graph_breaks())  # what the first call compiles: its step's graphs
        length, cache = compiled.cache(causal_lm, batch, prompt_length + new)
        placing = compiled.placing(causal_lm, batch, adapter) if device.type == "cuda" else 0
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
        if t + 1 == new or ((t + 1) % CHECK_EVERY == 0 and t + 1 > sampling.min_new_tokens and bool(out.ended.all())):
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
        graphs, broke = _compiled_graphs() - breaks[0], _graph_breaks() - breaks[1]
        if broke:
            logger.warning("decode compiled for %d rows: graph breaks split the step into %d graphs, which each token "
                           "runs apart (%s)", batch, graphs, "; ".join(reason.strip().splitlines()[0] for reason in broke))
    elif placing:
        sync(device)
        logger.info("decode compiled for %d rows: the dense copies lie where no earlier decode found them (placing "
                    "%d), so its CUDA graphs were recorded anew: this decode took %.1f s", batch, placing,
                    time.perf_counter() - started)
    return Decoded(out.tokens[:live, :steps], out.logprobs[:live, :steps], out.entropy[:live, :steps],
                   out.ended[:live])
