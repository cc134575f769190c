"""A run's memory options in one object, checked once at start against the launch.

    options = MemoryOptions.of(model_args, stage_args)
    options.check(accelerator)                 # one line for a combination that cannot run
    options.may_offload(accelerator)           # what the budget planner may turn on

The options that constrain each other or the launch: the two host offloads (input embedding, saved
activations), compiled decoder layers and the rollouts' decode path (PPO, GRPO). What each cannot run with -
ZeRO-3 / FSDP, each other - stops the run before anything loads; one that cannot take effect on this device
(an offload on the CPU, a tied embedding) is said in one line where the model loads (`trainer.model.loading`,
`trainer.model.shared_base`) and changes nothing.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from profiling import resolve
from profiling.plan import OFFLOADS, offload_conflict, offloads_allowed
from trainer.engine.launch import LaunchError, is_fsdp, shards_parameters

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class MemoryOptions:
    offload_embeddings: bool
    offload_activations: bool
    compile_layers: bool
    decode: str = "eager"  # PPO, GRPO: the rollouts' decode path (auto until `decode_path` settles it)

    @classmethod
    def of(cls, model_args, stage_args) -> "MemoryOptions":
        return cls(model_args.offload_embeddings, model_args.offload_activations, model_args.compile_layers,
                   getattr(stage_args, "decode", "eager"))

    def decode_path(self, accelerator) -> str:
        """--decode as this run decodes (`profiling.resolve.decode_path`: auto is compiled on CUDA), said in
        one line where auto chose."""
        path = resolve.decode_path(self.decode, accelerator.device.type, self.offload_embeddings,
                                   shards_parameters(accelerator))
        if self.decode == "auto":
            why = ("CUDA: each decode step replayed as CUDA graphs; the first rollout compiles it"
                   if path == "compiled" else "eager decoding on " + (
                       "the CPU" if accelerator.device.type != "cuda" else
                       "ZeRO-3 / FSDP" if shards_parameters(accelerator) else "an embedding in host memory"))
            logger.info("decode auto: %s (%s)", path, why)
        return path

    def check(self, accelerator) -> None:
        """Refuse, in one line, what cannot run together or under this launch (ZeRO-3 / FSDP shard the base)."""
        mode = ("FSDP" if is_fsdp(accelerator) else "DeepSpeed ZeRO-3") if shards_parameters(accelerator) else None
        for name in OFFLOADS:  # the planner's rule (`offload_conflict`), for the offloads given
            if getattr(self, name) and (why := offload_conflict(name, self.decode, self.compile_layers, mode)):
                raise LaunchError(f"--{name} {why}")
        if mode and self.compile_layers:
            raise LaunchError(f"--compile_layers is not supported under {mode}: its module hooks, which gather "
                              "the partitioned weights, would run inside the compiled decoder layers (untested); "
                              "drop --compile_layers")

    def may_offload(self, accelerator) -> tuple[str, ...]:
        """The offloads a budget plan may turn on under this launch (`profiling.plan.offloads_allowed`)."""
        return offloads_allowed(self.decode, self.compile_layers, shards_parameters(accelerator))
