"""The memory and speed choices of one run, every `auto` settled: what the model builder, the harness, the
rollouts and the recorder read (`trainer.engine.settle` makes it once, at the start of a run).

The argument classes (`foundation.settings`) stay what the user asked for; a RunPlan is what the run does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from foundation.cli import AUTO, unplanned_defaults

# Every choice a plan holds, in the order its table prints them.
CHOICES = ("quantization", "dtype", "optimizer", "gradient_checkpointing", "offload_embeddings", "offload_activations",
           "compile_layers", "micro_batch_size", "rollout_micro_batch_size", "decode", "generation_weights")


@dataclass(frozen=True)
class RunPlan:
    quantization: str  # nf4 or none
    dtype: str  # the compute dtype: float32, bfloat16 or float16
    optimizer: str  # adamw_torch, adamw_8bit or paged_adamw_8bit (DeepSpeed's own where its config names one)
    gradient_checkpointing: bool
    offload_embeddings: bool  # the input embedding in host memory
    offload_activations: bool  # the update's saved activations in host memory
    compile_layers: bool
    micro_batch_size: int  # rows of a training pass
    rollout_micro_batch_size: int = 0  # PPO, GRPO: rows of a generate / score pass
    decode: str = "eager"  # PPO, GRPO: the rollouts' decode path, eager or compiled
    generation_weights: str = "quantized"  # PPO, GRPO: what decoding reads (trainer.model.decode_weights)
    planned: frozenset[str] = frozenset()  # the choices the run made (auto settled); the others were given

    @classmethod
    def of(cls, model_args, train_args=None, stage_args=None, **settled: Any) -> "RunPlan":
        """The plan of settings as given (ModelArguments, TrainArguments, a stage's arguments), with what a
        caller settled (`settled`: quantization, dtype, optimizer where auto) in place of their values; each
        choice left auto is marked planned, and a true/false or number one takes its value where nothing plans
        it (`foundation.cli.unplanned_defaults`). Without train arguments (a model built outside a run)
        micro_batch_size is 1 and the optimizer none."""
        values, planned = {"micro_batch_size": 1, "optimizer": "none"}, set()
        for settings in filter(None, (model_args, train_args, stage_args)):
            asked = {name: getattr(settings, name) for name in CHOICES if hasattr(settings, name)}
            defaults = unplanned_defaults(type(settings))
            planned |= {name for name, value in asked.items() if value == AUTO}
            values.update({name: defaults.get(name, value) if value == AUTO else value
                           for name, value in asked.items()})
        return cls(**values | settled, planned=frozenset(planned))

    def table(self) -> str:
        """The plan as the log prints it at the start of a run: each choice marked set or planned."""
        lines = ["run plan:"]
        for name in self.choices():
            value = getattr(self, name)
            shown = str(value).lower() if isinstance(value, bool) else str(value)
            lines.append(f"  {name} {shown}  ({'planned' if name in self.planned else 'set'})")
        return "\n".join(lines)

    def record(self) -> dict[str, Any]:
        """The choices as plain JSON data (config.json's "plan"), the rollouts' where the run has any."""
        return {name: getattr(self, name) for name in self.choices()}

    def choices(self) -> tuple[str, ...]:
        return CHOICES if self.rollout_micro_batch_size else CHOICES[:-3]
