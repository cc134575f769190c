"""Rollout decoding: the prompt once through the model (prefill), then one token per step from a KV cache.

Each step's logits give the sampled token and, from the same logits, its log-prob and entropy at the sampling
temperature: the full softmax of the upcast logits divided by the temperature, before min-length, top-k and
top-p masks, which is what a scoring pass of the policy gives (`trainer.rl.scoring`). Rows that reached EOS
emit pad; whether every row has ended is read on the host once every `CHECK_EVERY` steps, never per token, and
not before `min_new_tokens` (no row can end sooner).

Paths (`--decode`): `eager` grows a KV cache by one position a step and runs each step eagerly; `compiled`
allocates the KV cache once at its full length and compiles the step (torch.compile; on CUDA in
"reduce-overhead" mode, so each token replays CUDA graphs; its decoder layers as one nested compile region,
compiled once for all of them). The compiled step and its caches are kept by the run's `Generator`, one cache
per batch size, so later rollouts replay what the first captured: the LoRA weights are updated in place by the
optimizer, and the graphs read them where they are.

What a step multiplies - dense copies of a 4-bit base, the LoRA weights in the compute dtype - is
`trainer.model.decode_weights`'s.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, fields
from functools import partial
from types import FunctionType
from typing import Iterator, Optional, Sequence, Union

import torch
from torch import nn
from transformers.cache_utils import StaticLayer

from foundation.cli import UsageError
from foundation.settings import DECODE_CHOICES
from foundation.stages import POLICY
from profiling import components as C, resolve
from profiling.decode import sync
from trainer.model.attention import DECODE_ATTENTION, decode_attention
from trainer.model.decode_weights import DecodeWeights, SharedProducts

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

    @classmethod
    def empty(cls, batch: int, new: int, pad_id: int, device, ended: torch.Tensor) -> "Decoded":
        return cls(torch.full((batch, new), pad_id, dtype=torch.long, device=device),
                   torch.zeros(batch, new, device=device), torch.zeros(batch, new, device=device), ended)

    def put(self, t: int, tokens: torch.Tensor, logprobs: torch.Tensor, entropy: torch.Tensor, eos_id: int) -> None:
        """Step `t`'s tokens and their log-probs and entropies; a row that drew EOS has ended."""
        self.tokens[:, t], self.logprobs[:, t], self.entropy[:, t] = tokens, logprobs, entropy
        self.ended |= tokens == eos_id

    def first(self, rows: int, steps: int) -> "Decoded":
        return Decoded(self.tokens[:rows, :steps], self.logprobs[:rows, :steps], self.entropy[:rows, :steps],
                       self.ended[:rows])


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


class _Regions:
    """Every decoder layer's forward marked for a compiled decode (`layer_step`): each layer one nested compile
    region (`torch.compiler.nested_compile_region`), so the compiled step compiles one layer and stamps its
    code out for the others instead of compiling each anew. Outside a compile the mark is a no-op. A layer
    compiled for training (--compile_layers) is marked in its no-grad forward, the one a decode runs; a layer
    whose forward is replaced otherwise keeps it; where torch has no such regions nothing is marked."""

    def __init__(self, causal_lm: nn.Module, on: bool):
        from transformers.modeling_layers import GradientCheckpointingLayer

        from trainer.model.compiled import CompiledLayer

        region = getattr(torch.compiler, "nested_compile_region", None)
        mark = on and region is not None
        self.marked: dict[object, object] = {}  # a decoder layer class, `_layer_with_cache` -> its region
        self.count = 0
        for layer in causal_lm.modules():
            if not isinstance(layer, GradientCheckpointingLayer):
                continue
            cls, own = type(layer), vars(layer).get("forward")
            if mark and cls not in self.marked:
                self.marked[cls] = region(cls.forward)
                self.marked.setdefault(_layer_with_cache, region(_layer_with_cache))
            if isinstance(own, CompiledLayer):
                own.eager = self.layer_step if mark else cls.forward
                self.count += mark
                continue
            ours = isinstance(own, partial) and getattr(own.func, "__func__", None) is _Regions.layer_step
            if mark and (own is None or ours):
                layer.forward = partial(self.layer_step, layer)
                self.count += 1
            elif not on and ours:
                del layer.forward

    def layer_step(self, layer, hidden_states, *args, **kwargs):
        """A decoder layer's forward in a decode. Compiled, it is a region: where the layer's attention writes the
        step into its static cache itself (`_static_cache_of`), one whose inputs are tensors only, which torch
        traces once for every layer (`_layer_with_cache`); else the layer's own forward, traced per layer and
        compiled once. Not compiled, the layer's own forward."""
        own = type(layer).forward
        if not torch.compiler.is_compiling():
            return own(layer, hidden_states, *args, **kwargs)
        cache = None if args else _static_cache_of(layer, kwargs)
        if cache is None:
            return self.marked[type(layer)](layer, hidden_states, *args, **kwargs)
        cos, sin = kwargs["position_embeddings"]
        return self.marked[_layer_with_cache](layer, hidden_states, kwargs.get("attention_mask"),
                                              kwargs.get("position_ids"), cos, sin, kwargs.get("cache_position"),
                                              *cache)


def _static_cache_of(layer, kwargs: dict) -> Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(keys, values, tokens held) of the static cache layer a decoder layer's call writes to, where its attention
    (`trainer.model.attention.single_token_gqa`, the decode's implementation) can write the step itself: a
    transformers `StaticLayer` (no sliding window) already filled by the prompt, and no argument the region
    would not pass on; else None. The attention setting read is the one transformers reads at every call."""
    attention = getattr(layer, "self_attn", None)
    index = getattr(attention, "layer_idx", None)
    if (index is None or getattr(getattr(attention, "config", None), "_attn_implementation", None) != DECODE_ATTENTION
            or kwargs.get("position_embeddings") is None or not _known_arguments(tuple(kwargs))):
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


class CompiledStep:
    """A compiled decode step and one full-length KV cache per batch size, reset between rollouts and kept
    between them (the estimator prices it in every phase): prompt + new tokens rounded up to CACHE_ROUND,
    grown only when a longer rollout comes. `regions`: its decoder layers compiled as one reused region
    (`_Regions`), else the step is compiled whole."""

    def __init__(self, causal_lm, regions: bool = True):
        import torch._inductor

        mode = "reduce-overhead" if next(causal_lm.parameters()).device.type == "cuda" else None
        self.regions = _Regions(causal_lm, regions)
        # a LoRA-B product is a rank-wide sum (`_times_lora_b`): unrolled into the kernel reading it
        ranks = [a.weight.shape[0] for m in causal_lm.modules() for a in getattr(m, "lora_A", {}).values()]
        options = {**(torch._inductor.list_mode_options(mode) if mode else {}),
                   "unroll_reductions_threshold": max([UNROLL_BELOW, *(r + 1 for r in ranks)]),
                   "post_grad_custom_pre_pass": SharedProducts()}
        self.step = torch.compile(_own_copy(_step), options=options, fullgraph=False)
        self.caches: dict[int, tuple[int, object]] = {}
        # (batch size, adapter) -> where its decodes found the dense copies, since its cache was made
        self.placings: dict[tuple[int, str], set[tuple[int, ...]]] = {}

    def __iter__(self) -> Iterator[torch.Tensor]:
        """The kept caches' key and value tensors."""
        for _, cache in self.caches.values():
            for layer in getattr(cache, "layers", ()):
                yield from (t for t in (getattr(layer, "keys", None), getattr(layer, "values", None))
                            if isinstance(t, torch.Tensor))

    def describe(self) -> str:
        return (f"{self.regions.count} decoder layers compiled as one reused region" if self.regions.count
                else "the step compiled whole")

    def rows_for(self, batch: int) -> int:
        """The batch size to decode `batch` rows at: the smallest one with a cache already that holds them (its
        compiled step and its cache serve them), else `batch` itself."""
        return min((rows for rows in self.caches if rows >= batch), default=batch)

    def placing(self, dense: Sequence[torch.Tensor], batch: int, adapter: str) -> int:
        """0 where the `dense` copies the step reads (`DecodeWeights`) lie where an earlier decode of `batch` rows
        of `adapter` (whose LoRA copies it reads) found them since its cache was made, or there are none (the
        step's CUDA graphs recorded there are replayed), else how many placings those decodes have found, this
        one counted: a new one has its CUDA graphs recorded anew, which torch keeps beside the earlier ones."""
        places = tuple(w.data_ptr() for w in dense)
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


def _own_copy(function: FunctionType) -> FunctionType:
    """`function` with a code object of its own. torch.compile keeps the frames it compiled on the code object:
    every compiled step made from the one `_step` (a generator each, or compiled anew) would add to one list of
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


class Generator:
    """Decoding for one shared-base model (`trainer.model.shared_base`), one per run: the path (`decode`) and the
    weights a step multiplies (`generation_weights`), and all a decode keeps between calls - the compiled step
    and its static KV caches, the dense copies and LoRA compute copies (`DecodeWeights`) - held here, none of
    it in module state or on the model. A memory recorder passed in counts what it holds (`held`,
    `swapped_out`) in every phase. `rows`: how many rows a rollout samples and scores together (a run's
    rollout_micro_batch_size; None: all at once). Rollouts, evaluation, `trainer.compare` and the decode benchmark
    call it."""

    def __init__(self, model, decode: str = "eager", generation_weights: str = "quantized", recorder=None,
                 rows: Optional[int] = None):
        causal_lm = model.causal_lm
        device = causal_lm.get_output_embeddings().weight.device  # where the steps run
        on_host = causal_lm.get_input_embeddings().weight.device != device  # --offload_embeddings
        self.model, self.decode = model, check_path(decode, device.type, on_host)
        self.weights = DecodeWeights(model.causal_lm, generation_weights)
        self.compiled: Optional[CompiledStep] = None
        self.rows = rows
        if recorder is not None:
            recorder.track(holder=self)

    def pass_rows(self, batch: int) -> int:
        """Rows a pass over `batch` rows takes at a time: `rows`, or all of them."""
        return self.rows or batch

    def held(self) -> dict[str, list[torch.Tensor]]:
        """What decoding keeps beside the model, by memory component."""
        return {C.GENERATION_WEIGHTS: self.weights.tensors(), C.KV_CACHE: list(self.compiled or ())}

    def swapped_out(self) -> list[nn.Module]:
        """The 4-bit layers out of the module tree while dense copies stand in for them."""
        return self.weights.swapped_out()

    def holding(self, adapter: str = POLICY):
        """A context: the dense copies made once for every `sample` in the body (a rollout's chunks)."""
        return self.weights.dense(adapter)

    def release(self) -> None:
        """Free resident dense copies (the next decode makes them again)."""
        self.weights.release()

    def compile_anew(self, regions: bool = True) -> None:
        """From the next compiled decode on, compile the step anew (fresh caches too), its decoder layers as one
        reused region or the step whole: the fallback when the regions do not compile, and the decode
        benchmark's comparison of the two."""
        self.compiled = CompiledStep(self.model.causal_lm, regions=regions)

    @torch.no_grad()
    def sample(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, sampling: Sampling, eos_id: int,
               pad_id: int, adapter: str = POLICY) -> Decoded:
        """Up to `sampling.max_new_tokens` tokens after each left-padded prompt under `adapter`, in eval mode (no
        dropout); the train mode and active adapter are restored after."""
        model, device = self.model, prompt_ids.device
        compiled = self.decode == "compiled"
        was_training = model.training
        model.eval()
        try:
            with model.use_adapter(adapter), self.weights.dense(adapter), \
                    self.weights.lora_copies(model, adapter, device.type, keep=compiled), \
                    decode_attention(model.causal_lm):
                if not compiled:
                    from transformers import DynamicCache

                    cache = DynamicCache(config=model.causal_lm.config)
                    length = prompt_ids.shape[1] + sampling.max_new_tokens
                    return self._loop(_step, cache, length, prompt_ids, prompt_mask, sampling, eos_id, pad_id,
                                      static=False)
                try:
                    return self._compiled(prompt_ids, prompt_mask, sampling, eos_id, pad_id, adapter)
                except compile_errors() as exc:
                    if not self.compiled.regions.count:
                        raise
                    logger.warning("decode compiled: the decoder layers did not compile as one reused region "
                                   "(%s: %s); compiling the step whole", type(exc).__name__,
                                   " ".join(str(exc).split())[:200])
                    self.compile_anew(regions=False)
                    return self._compiled(prompt_ids, prompt_mask, sampling, eos_id, pad_id, adapter)
        finally:
            model.train(was_training)

    def _compiled(self, prompt_ids, prompt_mask, sampling: Sampling, eos_id: int, pad_id: int,
                  adapter: str) -> Decoded:
        """The loop through the compiled step at a batch size it keeps a cache for: fewer rows than one (a last
        chunk, an evaluation) ride in its graph and cache, in rows that start as ended; what the first call of
        a batch size compiled, or a new placing of the dense copies recorded, is said after."""
        causal_lm, started = self.model.causal_lm, time.perf_counter()
        if self.compiled is None:
            self.compile_anew()
        held = self.compiled
        live, prompt_length = prompt_ids.shape
        batch = held.rows_for(live)
        if batch > live:
            prompt_ids = torch.cat([prompt_ids, prompt_ids[:1].expand(batch - live, -1)])
            prompt_mask = torch.cat([prompt_mask, prompt_mask[:1].expand(batch - live, -1)])
        first_call, graphs, breaks = batch not in held.caches, _compiled_graphs(), _graph_breaks()
        length, cache = held.cache(causal_lm, batch, prompt_length + sampling.max_new_tokens)
        device = prompt_ids.device
        placing = held.placing(self.weights.tensors(), batch, adapter) if device.type == "cuda" else 0
        out = self._loop(held.step, cache, length, prompt_ids, prompt_mask, sampling, eos_id, pad_id, static=True,
                         live=live)
        if first_call:
            sync(device)
            logger.info("decode compiled for %d rows (%s): the first decode took %.1f s, compilation%s included "
                        "(once per batch size)", batch, held.describe(), time.perf_counter() - started,
                        " and CUDA graph capture" if device.type == "cuda" else "")
            graphs, broke = _compiled_graphs() - graphs, _graph_breaks() - breaks
            if broke:
                logger.warning("decode compiled for %d rows: graph breaks split the step into %d graphs, which each "
                               "token runs apart (%s)", batch, graphs,
                               "; ".join(reason.strip().splitlines()[0] for reason in broke))
        elif placing:
            sync(device)
            logger.info("decode compiled for %d rows: the dense copies lie where no earlier decode found them "
                        "(placing %d), so its CUDA graphs were recorded anew: this decode took %.1f s", batch,
                        placing, time.perf_counter() - started)
        return out

    def _prefill(self, prompt_ids, prompt_mask, positions, cache) -> torch.Tensor:
        """The prompts through the model into `cache`: the (B, V) logits after each."""
        return self.model.causal_lm(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=positions,
                                    past_key_values=cache, cache_position=torch.arange(prompt_ids.shape[1],
                                                                                       device=prompt_ids.device),
                                    use_cache=True, logits_to_keep=1).logits[:, -1]

    def _loop(self, step, cache, length: int, prompt_ids, prompt_mask, sampling: Sampling, eos_id: int,
              pad_id: int, static: bool, live: Optional[int] = None) -> Decoded:
        """Prefill, then `step` once per new token until `max_new_tokens` or every row ended (read every
        CHECK_EVERY steps, not before `min_new_tokens`). A `static` cache holds its `length` positions from the
        start (so each step's mask is the whole); a dynamic one grows a position a step, its mask with it. The
        first `live` rows are returned."""
        (batch, prompt_length), device = prompt_ids.shape, prompt_ids.device
        new, live = sampling.max_new_tokens, batch if live is None else live
        mask = torch.cat([prompt_mask, prompt_mask.new_ones(batch, length - prompt_length)], dim=1)
        positions = (prompt_mask.long().cumsum(-1) - 1).clamp(min=0)
        barred, free = _eos_bars(sampling, device)
        tokens, logprobs, entropy = pick_tokens(self._prefill(prompt_ids, prompt_mask, positions, cache), sampling,
                                                eos_id, barred)
        out = Decoded.empty(batch, new, pad_id, device, ended=torch.arange(batch, device=device) >= live)
        positions, cache_position = positions[:, -1:] + 1, torch.full((1,), prompt_length, device=device)
        for t in range(new):
            tokens = tokens.masked_fill(out.ended, pad_id)
            out.put(t, tokens, logprobs, entropy, eos_id)
            if t + 1 == new or ((t + 1) % CHECK_EVERY == 0 and t + 1 > sampling.min_new_tokens
                                and bool(out.ended.all())):
                return out.first(live, t + 1)
            if static and device.type == "cuda":
                torch.compiler.cudagraph_mark_step_begin()  # this step's inputs are copies: the last replay's may go
            tokens, logprobs, entropy = step(self.model.causal_lm, tokens[:, None], positions,
                                             cache_position, mask if static else mask[:, : prompt_length + t + 1],
                                             cache, sampling, eos_id, barred if t + 1 < sampling.min_new_tokens
                                             else free)
            positions, cache_position = positions + 1, cache_position + 1
        return out.first(live, new)


def _eos_bars(sampling: Sampling, device) -> tuple:
    """(barred, free): EOS barred before min_new_tokens and not after - 0-dim tensors, so that one compiled step
    serves the steps on both sides of it; plain False where nothing is barred."""
    if sampling.min_new_tokens <= 0:
        return False, False
    return torch.ones((), dtype=torch.bool, device=device), torch.zeros((), dtype=torch.bool, device=device)
