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
from profiling.plan import offloads_allowed
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
        if shards_parameters(accelerator):
            mode = "FSDP" if is_fsdp(accelerator) else "DeepSpeed ZeRO-3"
            if self.offload_embeddings:
                raise LaunchError(f"--offload_embeddings is not supported under {mode}, which partitions the "
                                  "embedding across ranks already; drop --offload_embeddings")
            if self.offload_activations:
                raise LaunchError(f"--offload_activations is not supported under {mode}: the weights it gathers "
                                  "would be taken for activations and copied to the host; drop --offload_activations")
            if self.compile_layers:
                raise LaunchError(f"--compile_layers is not supported under {mode}: its module hooks, which gather "
                                  "the partitioned weights, would run inside the compiled decoder layers (untested); "
                                  "drop --compile_layers")
        if self.offload_activations and self.compile_layers:
            raise LaunchError("--offload_activations and --compile_layers do not combine: compiled layers do not "
                              "run saved-tensor hooks; drop one")
        if self.offload_embeddings and self.decode == "compiled":
            raise LaunchError(f"--offload_embeddings needs --decode eager: each decode step looks its token's row "
                              f"up in host memory, which a {self.decode} decode step cannot capture")

    def may_offload(self, accelerator) -> tuple[str, ...]:
        """The offloads a budget plan may turn on under this launch (`profiling.plan.offloads_allowed`)."""
        return offloads_allowed(self.decode, self.compile_layers, shards_parameters(accelerator))
