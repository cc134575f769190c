"""Exact byte counts by walking the tensors a model and an optimizer hold (works on any device).

Every tensor is counted once by its storage (tied embeddings, shared codebooks and views are not
double counted) and attributed to the first component that claims it. What is counted is the
storage's logical size; the CUDA caching allocator rounds each block up to 512 bytes, which the
allocator statistics see and this walk does not (a few hundred KiB for a 7B model).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Iterable, Iterator, Optional

import torch
from torch import nn

from profiling import components as C


class TensorLedger:
    """Bytes per (component, device), each storage counted once."""

    def __init__(self) -> None:
        self._seen: set[tuple[str, int]] = set()
        self._bytes: dict[tuple[str, str], int] = defaultdict(int)
        self._paged: dict[str, int] = defaultdict(int)

    def add(self, component: str, tensor: torch.Tensor) -> None:
        if tensor.device.type == "meta":
            return
        try:
            storage = tensor.untyped_storage()
            key, size = (str(tensor.device), storage.data_ptr()), storage.nbytes()
        except (RuntimeError, NotImplementedError):  # sparse or other storage-less layouts
            key, size = (str(tensor.device), id(tensor)), tensor.numel() * tensor.element_size()
        if key in self._seen:
            return
        self._seen.add(key)
        self._bytes[(component, str(tensor.device))] += size
        if getattr(tensor, "is_paged", False):
            # bitsandbytes paged buffers are CUDA managed memory: outside torch's allocator statistics.
            self._paged[component] += size

    def components(self, device: Optional[str] = None) -> dict[str, int]:
        """Bytes per component on `device` (a str like 'cuda:0' or 'cpu'), or on every device."""
        out: dict[str, int] = defaultdict(int)
        for (component, dev), size in self._bytes.items():
            if device is None or dev == device:
                out[component] += size
        return {k: out[k] for k in C.ordered(out)}

    def elsewhere(self, device: str) -> dict[str, dict[str, int]]:
        """Bytes per other device and component: CPU-offloaded optimizer states, CPU step counters."""
        out: dict[str, dict[str, int]] = defaultdict(dict)
        for (component, dev), size in self._bytes.items():
            if dev != device:
                out[dev][component] = out[dev].get(component, 0) + size
        return dict(out)

    def storage_keys(self) -> set[tuple[str, int]]:
        return set(self._seen)

    def paged(self) -> dict[str, int]:
        return dict(self._paged)


# ---------------------------------------------------------------- model tensors


def quant_state_tensors(state) -> Iterator[torch.Tensor]:
    """Every tensor a bitsandbytes QuantState holds, nested states included.

    With double quantization that is the 8-bit absmax, its fp32 offset, the NF4 codebook and the
    nested state's fp32 absmax and 8-bit codebook. Walked generically (vars, recursively) because
    bitsandbytes rewrites the state in place, e.g. un-nesting it for its AVX512-BF16 CPU layout.
    """
    stack, visited = [state], set()
    while stack:
        obj = stack.pop()
        if obj is None or id(obj) in visited:
            continue
        visited.add(id(obj))
        for value in vars(obj).values():
            if isinstance(value, torch.Tensor):
                yield value
            elif hasattr(value, "absmax") and hasattr(value, "blocksize"):  # a nested QuantState
                stack.append(value)


def _adapter_of(param_name: str) -> Optional[str]:
    """'...q_proj.lora_A.policy.weight' -> 'policy'; None for a non-LoRA tensor."""
    parts = param_name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part.startswith("lora_"):
            return parts[i + 1]
    return None


def _head_owners(model: nn.Module) -> dict[int, str]:
    """id(param) -> head name, for SharedBaseModel-style `model.heads` (a ModuleDict of scalar heads)."""
    heads = getattr(model, "heads", None)
    if not isinstance(heads, nn.ModuleDict):
        return {}
    return {id(p): name for name, module in heads.items() for p in module.parameters()}


def _output_embedding_ids(model: nn.Module) -> set[int]:
    found = set()
    for module in model.modules():
        getter = getattr(module, "get_output_embeddings", None)
        if getter is None or isinstance(module, nn.Linear):
            continue
        try:
            out = getter()
        except (AttributeError, NotImplementedError):
            continue
        if out is not None:
            found.add(id(out))
    return found


def _is_4bit(param: torch.Tensor) -> bool:
    return getattr(param, "quant_state", None) is not None and getattr(param, "bnb_quantized", True)


def model_parameters(model: nn.Module) -> Iterator[tuple[str, nn.Parameter, str]]:
    """(name, parameter, component) for every parameter of `model`, each once."""
    heads = _head_owners(model)
    lm_heads = _output_embedding_ids(model)
    seen = set()
    for module_name, module in model.named_modules():
        for local, param in module._parameters.items():
            if param is None or id(param) in seen:
                continue
            seen.add(id(param))
            name = f"{module_name}.{local}" if module_name else local
            adapter = _adapter_of(name)
            if adapter is not None:
                component = C.adapter(adapter)
            elif id(param) in heads:
                component = C.head(heads[id(param)])
            elif isinstance(module, nn.Linear) and local == "weight" and id(module) not in lm_heads:
                # The layers quantization targets, counted the same way whether quantized or not.
                component = C.BASE_WEIGHTS
            else:
                component = C.BASE_OTHER
            yield name, param, component


def add_model(ledger: TensorLedger, model: nn.Module, gradients: bool = True, holders: Iterable = ()) -> None:
    """Weights, quantization constants, adapters and heads of `model`; then their .grad tensors. `holders` hold
    tensors for the model outside its module tree (a decoder, `trainer.model.decode.Generator`): `held()`,
    component -> tensors, counted first (a dense copy swapped into the tree is a buffer there), and
    `swapped_out()`, the layers those copies stand in for, counted as the model's own."""
    swapped_out = []
    for holder in holders:
        for component, tensors in holder.held().items():
            for tensor in tensors:
                ledger.add(component, tensor)
        swapped_out += holder.swapped_out()
    params = [*model_parameters(model), *(p for layer in swapped_out for p in model_parameters(layer))]
    for _, param, component in params:
        ledger.add(component, param)
        if _is_4bit(param):
            for t in quant_state_tensors(param.quant_state):
                ledger.add(C.BASE_QUANT_CONSTANTS, t)
    for _, buffer in model.named_buffers():
        ledger.add(C.BASE_OTHER, buffer)
    if gradients:
        add_gradients(ledger, (p for _, p, _ in params))


def add_gradients(ledger: TensorLedger, params: Iterable[torch.Tensor]) -> None:
    for param in params:
        if param.grad is not None:
            ledger.add(C.GRADIENTS, param.grad)


# ---------------------------------------------------------------- optimizer tensors


def _optimizer_chain(optimizer) -> Iterator[object]:
    """The optimizer and every optimizer it wraps (Accelerate's wrapper, DeepSpeed's ZeRO optimizer)."""
    seen = set()
    while optimizer is not None and id(optimizer) not in seen:
        seen.add(id(optimizer))
        yield optimizer
        optimizer = getattr(optimizer, "optimizer", None)


def _tensors_in(value) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors_in(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors_in(v)


def add_optimizer(ledger: TensorLedger, optimizer) -> None:
    """What the optimizer really holds: torch AdamW's fp32 moments and step counters, bitsandbytes'
    8-bit state1/state2 with their absmax and qmap tensors (fp32 moments for tensors under its
    min_8bit_size), and DeepSpeed ZeRO's fp32 master partitions."""
    for level in _optimizer_chain(optimizer):
        state = getattr(level, "state", None)
        if isinstance(state, dict):
            for per_param in state.values():
                for t in _tensors_in(per_param):
                    ledger.add(C.OPTIMIZER_STATES, t)
        for attr in ("single_partition_of_fp32_groups", "fp32_groups_flat_partition"):
            for t in _tensors_in(getattr(level, attr, None)):
                ledger.add(C.OPTIMIZER_STATES, t)


def count_tensors(model: Optional[nn.Module] = None, optimizer=None, extra: Optional[dict] = None,
                  holders: Iterable = ()) -> TensorLedger:
    """One walk over a model (with gradients, and what `holders` hold for it: `add_model`) and an optimizer;
    `extra` maps component -> tensors."""
    ledger = TensorLedger()
    if model is not None:
        add_model(ledger, model, holders=holders)
    if optimizer is not None:
        add_optimizer(ledger, optimizer)
    for component, tensors in (extra or {}).items():
        for t in _tensors_in(tensors):
            ledger.add(component, t)
    return ledger
