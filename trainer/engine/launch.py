"""What the launch config (accelerate_configs/) means for the trainer, decided once at start.

Single GPU, DDP, DeepSpeed ZeRO-2/3 and FSDP all run the same harness; this module holds the few
places where they differ: the Accelerator a stage makes, which launch mode is on, the combinations
refused up front (one line, no stack trace), and the 4-bit storage dtype that sharding needs.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from foundation.cli import UsageError
from foundation.settings import ONLINE_RL_STAGES

# Stages that switch adapters on one base inside a step (DPO: policy/reference; PPO: all four) and,
# for PPO, generate with it.
MULTI_ADAPTER_STAGES = ("dpo", "ppo", "grpo")


class LaunchError(UsageError):
    """A launch config that cannot work with this run; the message says what to use instead."""


def _env_true(name: str) -> bool:
    return os.environ.get(name, "false").lower() in ("1", "true", "yes")


def deepspeed_requested() -> bool:
    """The launcher was given a DeepSpeed config (accelerate sets this for DEEPSPEED configs)."""
    return _env_true("ACCELERATE_USE_DEEPSPEED")


def fsdp_requested() -> bool:
    return _env_true("ACCELERATE_USE_FSDP")


# These take an Accelerator or Accelerate's AcceleratorState (both say `distributed_type`).
def is_deepspeed(accelerator) -> bool:
    from accelerate.utils import DistributedType

    return accelerator.distributed_type == DistributedType.DEEPSPEED


def is_fsdp(accelerator) -> bool:
    from accelerate.utils import DistributedType

    return accelerator.distributed_type == DistributedType.FSDP


def is_deepspeed_engine(model) -> bool:
    """A model `prepare` wrapped in DeepSpeed's engine (which clips, steps and skips in backward)."""
    return type(model).__name__ == "DeepSpeedEngine" or hasattr(model, "was_step_applied")


def deepspeed_config(accelerator) -> Optional[dict]:
    """The DeepSpeed config dict the engine will get (with 'auto' values still unfilled), or None."""
    if not is_deepspeed(accelerator):
        return None
    return getattr(accelerator, "state", accelerator).deepspeed_plugin.deepspeed_config


def zero_stage(accelerator) -> int:
    config = deepspeed_config(accelerator)
    return int(config.get("zero_optimization", {}).get("stage", 0)) if config else 0


def offloads_optimizer(config: Optional[dict]) -> bool:
    device = (config or {}).get("zero_optimization", {}).get("offload_optimizer", {}).get("device", "none")
    return device not in (None, "none")


def shards_parameters(accelerator) -> bool:
    """ZeRO-3 or FSDP: every parameter, the frozen base included, is split across ranks."""
    return is_fsdp(accelerator) or zero_stage(accelerator) == 3


@dataclass(frozen=True)
class Launch:
    """What a run's launch means for its memory choices (`trainer.engine.settle`)."""

    sharded: Optional[str] = None  # "FSDP" or "DeepSpeed ZeRO-3" where every parameter is split across ranks
    optimizer_offload: bool = False  # DeepSpeed keeps the optimizer states in host memory

    @classmethod
    def of(cls, accelerator) -> "Launch":
        sharded = ("FSDP" if is_fsdp(accelerator) else "DeepSpeed ZeRO-3") if shards_parameters(accelerator) else None
        return cls(sharded, offloads_optimizer(deepspeed_config(accelerator)))


def accelerator_kwargs() -> dict:
    """`cpu=` for Accelerator: True with no CUDA, except under DeepSpeed, which brings its own CPU backend.

    With cpu=True Accelerate never switches to DeepSpeed (it would silently train with plain
    gloo DDP and ignore the DeepSpeed config), so a DeepSpeed launch on CPU passes cpu=False.
    """
    if torch.cuda.is_available():
        return {"cpu": False}
    if fsdp_requested():
        raise LaunchError("FSDP (accelerate_configs/fsdp_qlora.yaml) needs CUDA GPUs; on CPU use "
                          "accelerate_configs/cpu_2proc.yaml (DDP over gloo) or a DeepSpeed config")
    return {"cpu": not deepspeed_requested()}


def resolve_mixed_precision(name: str) -> str:
    """--mixed_precision as the run uses it; fp16 without CUDA is refused (Accelerate would compute in fp32)."""
    if name == "fp16" and not torch.cuda.is_available():
        raise UsageError("--mixed_precision fp16 needs a CUDA GPU: on the CPU Accelerate ignores it and computes in "
                         "float32; use --mixed_precision no (or bf16, which the CPU runs)")
    if name != "auto":
        return name
    if torch.cuda.is_available():
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    return "no"


ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"
EXPANDABLE_SEGMENTS = "expandable_segments:True"


def set_allocator_defaults(environ=os.environ) -> Optional[str]:
    """On CUDA, unless PYTORCH_CUDA_ALLOC_CONF is set: PyTorch's caching allocator grows its segments in place
    (expandable_segments), so what it reserves stays close to what the run allocates and a card holds what
    the memory report counts. Before the allocator starts (the first CUDA allocation). Returns what it set."""
    if ALLOC_CONF in environ or not torch.cuda.is_available():
        return None
    environ[ALLOC_CONF] = EXPANDABLE_SEGMENTS
    return EXPANDABLE_SEGMENTS


def make_accelerator(args):
    """The Accelerator for a stage (TrainArguments `args`): accumulation, precision, trackers. Make it first."""
    from accelerate import Accelerator
    from accelerate.utils import GradientAccumulationPlugin, ProjectConfiguration

    set_allocator_defaults()  # before anything allocates on the device (start_run logs it)
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # DeepSpeed would otherwise warn on every import
    out = Path(args.output_dir)
    accelerator = Accelerator(
        **accelerator_kwargs(),
        mixed_precision=resolve_mixed_precision(args.mixed_precision),
        # Steps are counted in micro-batches, never cut short at an epoch boundary.
        gradient_accumulation_plugin=GradientAccumulationPlugin(
            num_steps=args.gradient_accumulation_steps, sync_with_dataloader=False),
        log_with=trackers_for(args.report_to) or None,
        project_config=ProjectConfiguration(project_dir=str(out), logging_dir=str(out / "tensorboard")),
    )
    fix_deepspeed_cpu_ranks(accelerator)
    return accelerator


def trackers_for(report_to: str) -> list[str]:
    """The Accelerate trackers `report_to` asks for, each installed (else one line naming what to install)."""
    from accelerate.tracking import get_available_trackers

    installed = [str(getattr(t, "value", t)) for t in get_available_trackers()]
    names = [n.strip() for n in report_to.split(",") if n.strip()]
    if names == ["none"]:
        return []
    if names == ["all"]:
        names = installed
    missing = [n for n in names if n not in installed]
    if missing:
        raise UsageError(f"--report_to {report_to}: {', '.join(missing)} is not installed (pip install "
                         f"{' '.join(m.replace('_', '-') for m in missing)}); installed: {', '.join(installed) or 'none'}")
    if "wandb" in names and not wandb_can_log():  # wandb.init would raise (or prompt) once the model is loaded
        raise UsageError(f"--report_to {report_to}: wandb finds no API key: set WANDB_API_KEY or run `wandb login`, "
                         "or log to the run folder with WANDB_MODE=offline")
    return names


WANDB_HOSTS = ("api.wandb.ai", "api.forge.coreweave.com")  # wandb's default servers (WANDB_BASE_URL names another)
WANDB_NO_KEY_MODES = ("offline", "disabled", "dryrun")


def wandb_can_log() -> bool:
    """Whether wandb.init finds what it needs without a prompt: a mode that needs no key (WANDB_MODE, WANDB_DISABLED,
    or `wandb offline` in a settings file), WANDB_API_KEY / WANDB_IDENTITY_TOKEN_FILE, or the netrc entry that
    `wandb login` writes (NETRC, else ~/.netrc)."""
    import configparser
    import netrc
    from urllib.parse import urlsplit

    env = os.environ
    if env.get("WANDB_MODE", "").lower() in WANDB_NO_KEY_MODES or _env_true("WANDB_DISABLED") or \
            env.get("WANDB_API_KEY") or env.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    settings = configparser.ConfigParser(interpolation=None)
    try:
        settings.read([Path(env.get("WANDB_CONFIG_DIR") or Path.home() / ".config" / "wandb") / "settings",
                       Path(env.get("WANDB_DIR") or ".") / "wandb" / "settings"])
    except (configparser.Error, UnicodeDecodeError):
        pass  # wandb reads it, or says what is wrong with it, itself
    saved = settings["default"] if settings.has_section("default") else {}
    if saved.get("mode", "").lower() in WANDB_NO_KEY_MODES or saved.get("api_key"):
        return True
    base = env.get("WANDB_BASE_URL") or saved.get("base_url")
    try:
        logins = netrc.netrc(env.get("NETRC") or Path.home() / ".netrc").hosts
    except (OSError, netrc.NetrcParseError):
        return False
    return any(logins.get(host, (None, None, None))[2] for host in ([urlsplit(base).netloc] if base else WANDB_HOSTS))


def setup_logging(accelerator, stream=None) -> None:
    level = logging.INFO if accelerator.is_main_process else logging.WARNING
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S", stream=stream or sys.stdout, force=True)
    # peft still reads transformers' deprecated `is_gradient_checkpointing`; nothing for a user to act on.
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
    for noisy in ("httpx", "urllib3", "filelock", "torch.distributed"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def reset_accelerate() -> None:
    """Each stage makes its own Accelerator; forget the previous stage's singletons (one process, several stages)."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def fix_deepspeed_cpu_ranks(accelerator) -> None:
    """Accelerate 1.15 on CPU under DeepSpeed reports 1 process, rank 0 on every rank: correct it.

    With no CUDA, Accelerate lets DeepSpeed open the process group (gloo) but then takes the
    'no backend' branch and records num_processes=1, process_index=0. Left so, every rank would
    read the same rows, write the checkpoints, and compute train_batch_size for one process (which
    DeepSpeed rejects). The real figures come from the process group DeepSpeed opened.
    """
    import torch.distributed as dist
    from accelerate.state import AcceleratorState, PartialState

    if not (is_deepspeed(accelerator) and dist.is_available() and dist.is_initialized()):
        return
    world, rank = dist.get_world_size(), dist.get_rank()
    if accelerator.num_processes == world and accelerator.process_index == rank:
        return
    local = int(os.environ.get("LOCAL_RANK", rank))
    for shared in (PartialState._shared_state, AcceleratorState._shared_state):
        shared.update(num_processes=world, process_index=rank, local_process_index=local)


def fill_deepspeed_autos(accelerator, model, max_grad_norm: float) -> None:
    """Fill the DeepSpeed config's "auto" values Accelerate cannot fill for the shared-base model.

    Accelerate sizes the ZeRO buckets from `model.config.hidden_size`, which the wrapper does not
    have (its base does), and fills gradient_clipping with 1.0 whatever the run asked for.
    """
    config = deepspeed_config(accelerator)
    if config is None:
        return
    if config.get("gradient_clipping") == "auto":
        config["gradient_clipping"] = max_grad_norm  # the engine clips; 0 turns clipping off
    hidden = model.causal_lm.config.hidden_size
    zero = config.get("zero_optimization", {})
    for key, value in (("reduce_bucket_size", hidden * hidden),  # Accelerate's own formulas
                       ("stage3_prefetch_bucket_size", int(0.9 * hidden * hidden)),
                       ("stage3_param_persistence_threshold", 10 * hidden)):
        if zero.get(key) == "auto":
            zero[key] = value


def describe_engine(model) -> Optional[str]:
    """One line on what DeepSpeed built (None for other launch modes), for the run log."""
    if not is_deepspeed_engine(model):
        return None
    offload = " with CPU optimizer offload" if model.zero_cpu_offload() else ""
    return (f"DeepSpeed ZeRO-{model.zero_optimization_stage()}{offload}: optimizer "
            f"{type(model.basic_optimizer).__name__}, {model.gradient_accumulation_steps()} micro-batches a step, "
            f"clipping at {model.gradient_clipping()}, {model.world_size} ranks")


def check_launch(accelerator, stage: Optional[str]) -> None:
    """Refuse, at start and in one line, the launch modes a stage cannot run under (the memory options'
    own rules: `trainer.engine.settle`)."""
    if not shards_parameters(accelerator):
        return
    mode = "FSDP" if is_fsdp(accelerator) else "DeepSpeed ZeRO-3"
    if stage not in MULTI_ADAPTER_STAGES:
        return
    what = ("generates with and switches its adapters on" if stage in ONLINE_RL_STAGES
            else "switches policy/reference adapters on")
    raise LaunchError(
        f"{stage} under {mode} is not supported: it {what} one base whose weights {mode} partitions across "
        "ranks (untested, and every switch or decoded token would gather the whole base); use "
        "accelerate_configs/multi_gpu.yaml or accelerate_configs/deepspeed_zero2_offload.yaml")


def quant_storage_for(compute_dtype: torch.dtype, accelerator=None) -> torch.dtype:
    """Storage dtype of packed 4-bit weights: the compute dtype where ZeRO-3 / FSDP shard them.

    Both shard flat tensors of one floating dtype; uint8-packed NF4 weights would be left out or
    mixed with the bf16 LoRA weights, so QLoRA under them stores the packed bytes as bf16 tensors
    (bnb_4bit_quant_storage), which changes nothing in the weights' values or size. Without an
    `accelerator`, the one this process made (Accelerate's shared state) decides.
    """
    if accelerator is None:
        from accelerate.state import AcceleratorState

        if not AcceleratorState._shared_state:
            return torch.uint8
        accelerator = AcceleratorState()
    return compute_dtype if shards_parameters(accelerator) else torch.uint8
