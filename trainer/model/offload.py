"""Activations kept in host memory between a training pass's forward and its backward (--offload_activations).

What autograd saves for backward outside a checkpointed layer - with gradient checkpointing each layer's input,
which is what checkpointing keeps, and the final norm's input; without it every saved tensor - is copied to
pinned host memory as the forward saves it and copied back when the backward needs it. Weights are left where
they are, and so are tensors under `min_bytes` (their copies would cost more than they free). Copies run on the
compute stream: the device memory a tensor frees is reused only after its copy, and the backward waits for its
copy back, so nothing needs synchronising.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from typing import Iterable, Iterator, Union

import torch

MIN_BYTES = 2**20

Packed = Union[torch.Tensor, tuple[torch.device, torch.Tensor]]


class SavedToHost:
    """`saved_tensors_hooks` that move CUDA tensors saved for backward to pinned host memory and back."""

    def __init__(self, weights: Iterable[torch.Tensor], min_bytes: int = MIN_BYTES) -> None:
        self._weights = {w.untyped_storage().data_ptr() for w in weights}
        self.min_bytes = min_bytes
        self.bytes = 0  # moved to the host since the last `hooks()`
        self._copies: dict[tuple, tuple[weakref.ref, Packed]] = {}

    def offloads(self, tensor: torch.Tensor) -> bool:
        """Whether `tensor` goes to the host: a CUDA activation of at least `min_bytes`, not a weight."""
        return (tensor.device.type == "cuda" and tensor.numel() * tensor.element_size() >= self.min_bytes
                and tensor.untyped_storage().data_ptr() not in self._weights)

    def _pack(self, tensor: torch.Tensor) -> Packed:
        if not self.offloads(tensor):
            return tensor
        # One copy of a tensor that several layers save (RoPE's cos and sin, the attention mask), while it is
        # alive: a dead one's memory may hold another tensor of the same shape by now.
        key = (tensor.data_ptr(), tensor.shape, tensor.stride(), tensor.dtype)
        seen = self._copies.get(key)
        if seen is not None and seen[0]() is not None:
            return seen[1]
        host = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout,
                           pin_memory=torch.cuda.is_available())
        host.copy_(tensor, non_blocking=True)
        self.bytes += host.numel() * host.element_size()
        self._copies[key] = (weakref.ref(tensor), (tensor.device, host))
        return tensor.device, host

    @staticmethod
    def _unpack(packed: Packed) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        device, host = packed
        return host.to(device, non_blocking=True)

    @contextmanager
    def hooks(self) -> Iterator["SavedToHost"]:
        """Around a training forward: what it saves for backward goes through `offloads`."""
        self.bytes, self._copies = 0, {}
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield self
        finally:
            self._copies = {}
