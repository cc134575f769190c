"""Bytes autograd saves for backward during a forward pass, measured on any device.

This is the part of activation memory that lives from the forward to the backward, counted from
the tensors themselves through `saved_tensors_hooks`, so it can be checked on CPU where no
allocator statistics exist. It does not see tensors a custom autograd Function keeps as plain
attributes, nor the inputs a non-reentrant checkpoint keeps for its recomputation (checkpointing
installs its own hooks, which take precedence inside the checkpointed region).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterable, Iterator

import torch


class SavedTensorMeter:
    """Sum of distinct storages saved for backward, excluding the storages in `exclude` (weights)."""

    def __init__(self, exclude: Iterable[tuple[str, int]] = ()) -> None:
        self._exclude = set(exclude)
        self._seen: set[tuple[str, int]] = set()
        self.bytes = 0
        self.tensors = 0

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.device.type != "meta":
            storage = tensor.untyped_storage()
            key = (str(tensor.device), storage.data_ptr())
            if key not in self._exclude and key not in self._seen:
                self._seen.add(key)
                self.bytes += storage.nbytes()
                self.tensors += 1
        # A detached alias, never the tensor itself: for a saved output, the tensor's grad_fn owns this
        # record, and a graph never run backward (a detached metric's) would keep it alive for good.
        return tensor.detach()

    @contextmanager
    def watch(self) -> Iterator["SavedTensorMeter"]:
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
            yield self
