"""--compile_layers: the decoder layers compiled (torch.compile) for the passes that train.

A GPU option: one graph per decoder layer fuses its elementwise work and drops per-op overhead in the
update's forward, recomputation and backward, at the price of a compilation on the first update (and one
per new adapter route or micro-batch size). The GPU kit's `speed` part measures it (`ppo_compiled`).
Launch modes that partition the base (ZeRO-3, FSDP) refuse it at start (`trainer.engine.launch`).
"""

from __future__ import annotations

import inspect
import logging
from functools import partial
from typing import Optional

import torch

from foundation.cli import first_line

logger = logging.getLogger(__name__)


def compile_layers(model) -> int:
    """Compile, with dynamic shapes, every decoder layer's forward for the passes that train; returns how many.
    No-grad passes (generation, scoring, evaluation) stay eager: decoding would compile one variant per KV-cache
    length. 0, with a one-line reason, where no compiler backend is present.

    A checkpointed layer compiles with its checkpoint (`CompiledLayer`), so the compiled backward skips
    recomputing what it never reads. Each adapter route and micro-batch size compiles its own variant; a layer
    that cannot compile whole (a graph break, torch's variant limit) compiles inside eager checkpointing with
    the shared base's `context_fn`, and past the limit runs eagerly: slower, still correct."""
    import shutil

    from transformers.modeling_layers import GradientCheckpointingLayer

    device = next(model.parameters()).device
    if device.type == "cuda":
        from torch.utils._triton import has_triton

        missing = None if has_triton() else "Triton is not installed"
    elif device.type == "cpu":
        missing = None if any(shutil.which(c) for c in ("g++", "c++", "clang++")) else "no C++ compiler (g++) found"
    else:
        missing = f"not tried on {device.type}"
    if missing:
        logger.warning("--compile_layers ignored: %s; the layers run eagerly", missing)
        return 0
    count, said = 0, set()  # the layers' warnings, each said once
    for layer in model.modules():
        if isinstance(layer, GradientCheckpointingLayer):
            layer.forward = CompiledLayer(layer, said)
            count += 1
    logger.info("compiled %d decoder layers for the passes that train (torch.compile, dynamic shapes); "
                "the first update compiles them", count)
    return count


# What transformers' checkpointing wrapper turns off before checkpointing a layer: the cache is not
# written in a recomputation (a layer that only reads it, `_can_checkpoint_with_cache`, keeps it).
_CACHE_KWARGS = ("past_key_values", "layer_past", "use_cache")


def _checkpointed(forward, layer, *args, **kwargs):
    """`forward(layer, ...)` under a non-reentrant checkpoint: compiled whole (fullgraph), the recomputation
    becomes part of the compiled backward."""
    return torch.utils.checkpoint.checkpoint(forward, layer, *args, use_reentrant=False, **kwargs)


class CompiledLayer:
    """A decoder layer's forward while autograd records: compiled with its checkpoint where the layer
    checkpoints (else its own forward in transformers' eager checkpoint, `compile_layers`), its own forward
    compiled where it does not, and transformers' eager forward without autograd. It holds its layer: a
    deep copy of the model would run the original's layers, so compile the copy anew."""

    def __init__(self, layer: torch.nn.Module, said: Optional[set[str]] = None):
        self.layer, self.said = layer, set() if said is None else said
        # transformers' checkpointing wrapper around the layer's own forward, run without autograd: a compiled decode
        # marks it as a nested compile region (trainer.model.decode._Regions)
        self.eager = type(layer).forward
        self.own = inspect.unwrap(self.eager)
        self.compiled = torch.compile(self.own, dynamic=True)
        self.compiled_checkpointed = torch.compile(_checkpointed, dynamic=True, fullgraph=True)
        self.whole = True  # False once the checkpointed forward failed to trace

    def __call__(self, *args, **kwargs):
        layer = self.layer
        if not torch.is_grad_enabled():
            return self.eager(layer, *args, **kwargs)
        if layer.gradient_checkpointing and layer.training:
            dropped = ("use_cache",) if getattr(layer, "_can_checkpoint_with_cache", False) else _CACHE_KWARGS
            kwargs = {k: v for k, v in kwargs.items() if k not in dropped}
            if self.whole:
                from torch._dynamo.exc import FailOnRecompileLimitHit, TorchDynamoException

                try:  # fullgraph: a failure is raised while tracing, before anything runs
                    return self.compiled_checkpointed(self.own, layer, *args, **kwargs)
                except FailOnRecompileLimitHit:  # this variant only
                    self._warn_once(f"--compile_layers: more checkpointed {type(layer).__name__} variants than torch "
                               "compiles; the others compile their forward inside the eager checkpoint")
                except TorchDynamoException as err:  # a graph break, an op it cannot trace: the other path
                    # traces the same code, so whatever it cannot do either surfaces there
                    self.whole = False
                    reason = first_line(err, 1000)
                    self._warn_once(f"--compile_layers: {type(layer).__name__} does not compile with its checkpoint "
                               f"({reason}); its forward compiles inside the eager checkpoint instead")
            return layer._gradient_checkpointing_func(partial(self.compiled, layer, **kwargs), *args)
        return self.compiled(layer, *args, **kwargs)

    def _warn_once(self, message: str) -> None:
        if message not in self.said:
            self.said.add(message)
            logger.warning(message)
