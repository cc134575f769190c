"""One frozen base model, several named LoRA adapters and scalar heads, switched by a context manager.

PPO holds `policy` (trainable), `reference` (frozen SFT copy), `value` (trainable, value head) and
`reward` (frozen, reward head) on ONE base: switching changes which LoRA weights the injected layers
use, never copies base weights. SFT, reward and DPO stages use the same class with fewer adapters;
which ones, and which train, is `foundation.stages`' table (`stage_specs`). What a pass gives is in
`trainer.model.outputs`; several adapters in one pass of the base, in `trainer.model.routing`.
"""

from __future__ import annotations

import logging
import os
import shutil
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Mapping, Optional, Sequence

import torch
from torch import nn

from foundation.cli import InputError
from foundation.files import atomic_folder
from foundation.run_plan import RunPlan
from foundation.settings import ModelArguments
from foundation.stages import stage_adapters
from trainer.model.adapter_fit import HEAD_FILE, PICKLED_WEIGHTS_FILE, WEIGHTS_FILE, check_adapter_fits
from trainer.model.offload import SavedToHost
from trainer.model.outputs import Outputs
from trainer.model.routing import Active, Route, Routing

logger = logging.getLogger(__name__)


class ScalarHead(nn.Module):
    """Linear map from the last hidden state to one scalar per token, kept in fp32 for stable scores."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, 1, dtype=torch.float32)
        nn.init.normal_(self.linear.weight, std=1.0 / (hidden_size + 1) ** 0.5)
        nn.init.zeros_(self.linear.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.linear(hidden.to(self.linear.weight.dtype)).squeeze(-1)

    def save(self, path: Path) -> None:
        from safetensors.torch import save_file

        save_file({k: v.detach().cpu().contiguous() for k, v in self.state_dict().items()}, str(path))

    def load(self, path: Path) -> None:
        from safetensors.torch import load_file

        self.load_state_dict(load_file(str(path)))


class HeadMissingError(InputError, FileNotFoundError):
    """A frozen adapter's scalar head has no saved weights to load."""


@dataclass
class AdapterSpec:
    """One adapter on the shared base: where it starts from, whether it trains, whether it has a head."""

    name: str
    trainable: bool = False
    init_from: Optional[str] = None  # a PEFT adapter folder; None starts a fresh LoRA (B = 0: the base itself)
    head: bool = False
    head_from: Optional[str] = None  # a folder holding head.safetensors; defaults to init_from when it has one


def stage_specs(stage: str, sources: Mapping[str, Optional[str]], without: Sequence[str] = ()) -> list[AdapterSpec]:
    """The adapters of `stage` (foundation.stages' table), each starting from `sources[role]` (a saved
    adapter folder; None or absent: a fresh LoRA), less the roles in `without`."""
    return [AdapterSpec(slot.role, trainable=slot.trainable, init_from=sources.get(slot.role), head=slot.head)
            for slot in stage_adapters(stage) if slot.role not in without]


def lora_config(args: ModelArguments, dropout: Optional[float] = None):
    from peft import LoraConfig

    targets = args.lora_target_modules
    return LoraConfig(
        r=args.lora_r, lora_alpha=args.lora_alpha,
        lora_dropout=args.lora_dropout if dropout is None else dropout,
        target_modules=targets if targets == "all-linear" else [t.strip() for t in targets.split(",") if t.strip()],
        bias="none", task_type="CAUSAL_LM",
    )


class SharedBaseModel(Outputs, Routing, nn.Module):
    """The shared-base multi-adapter model: adapters, switching, trainability, saving. Build it with `from_specs`.

    Its outputs (`logits`, `scores`, `label_logprobs`, ...) come from `Outputs`, the routed passes from `Routing`.
    """

    def __init__(self, peft_model, specs: list[AdapterSpec], heads: dict[str, ScalarHead]):
        super().__init__()
        self.peft = peft_model
        self.heads = nn.ModuleDict(heads)
        self.specs = {s.name: s for s in specs}
        self._lora_params = self._collect_lora_params()
        self._tuner_layers = self._collect_tuner_layers()
        self._route: Optional[Route] = None
        self._route_names: tuple[str, ...] = ()  # the route's adapters, in order
        self._route_rows = 0
        self._route_scales: dict = {}  # `Routing._scales_of` the route
        self._scales_by_route: dict = {}  # (route, device) -> its scales, kept for the passes that route again
        self._single: Optional[str] = None  # on a routable model: the one adapter whose LoRA outputs the layers add
        self._fallbacks_logged: set[str] = set()  # why `fused` ran one pass per adapter, said once each
        self.compiled_parts = 0  # decoder layers compiled for the passes that train (--compile_layers)
        self.saved_to_host: Optional[SavedToHost] = None  # --offload_activations on CUDA
        self.routable = self._install_routing()
        self._apply_trainability()

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def from_specs(cls, base: nn.Module, args: ModelArguments, specs: list[AdapterSpec]) -> "SharedBaseModel":
        """Wrap `base` (frozen, possibly 4-bit) with the adapters in `specs`; the first one ends up active."""
        from peft import PeftModel, get_peft_model

        if not specs:
            raise ValueError("at least one adapter is needed")
        check_specs(specs)
        for spec in specs:  # every adapter before the first loads: one of another base stops in one line
            if spec.init_from is not None:
                check_adapter_fits(spec.init_from, base, args.model_name_or_path, f"adapter '{spec.name}'")
        peft_model = None
        for spec in specs:
            dropout = None if spec.trainable else 0.0
            if spec.init_from is not None:
                if peft_model is None:
                    peft_model = PeftModel.from_pretrained(base, spec.init_from, adapter_name=spec.name,
                                                           is_trainable=spec.trainable)
                else:
                    peft_model.load_adapter(spec.init_from, adapter_name=spec.name, is_trainable=spec.trainable)
            else:
                cfg = lora_config(args, dropout)
                if peft_model is None:
                    peft_model = get_peft_model(base, cfg, adapter_name=spec.name)
                else:
                    peft_model.add_adapter(spec.name, cfg)
            # Dropout is this run's choice, not the saved adapter's: frozen adapters get none (their
            # outputs stay deterministic in train mode), trainable ones get this config's rate.
            _set_dropout(peft_model, spec.name, args.lora_dropout if spec.trainable else 0.0)
        hidden = base.config.hidden_size
        heads = {}
        for spec in specs:
            if not spec.head:
                continue
            head = ScalarHead(hidden).to(next(p.device for p in base.parameters()))
            source = head_source(spec)
            if source is not None:
                head.load(source)
            heads[spec.name] = head
        model = cls(peft_model, specs, heads)
        model._activate(specs[0].name)
        return model

    @property
    def lora_layers(self) -> list[nn.Module]:
        """peft's adapter layers on the base (each holds every adapter's weights)."""
        return self._tuner_layers

    def _collect_tuner_layers(self) -> list[nn.Module]:
        from peft.tuners.tuners_utils import BaseTunerLayer

        return [m for m in self.peft.modules() if isinstance(m, BaseTunerLayer)]

    def _collect_lora_params(self) -> list[tuple[nn.Parameter, str]]:
        from peft.tuners.tuners_utils import BaseTunerLayer

        found = []
        for module in self.peft.modules():
            if not isinstance(module, BaseTunerLayer):
                continue
            for attr in module.adapter_layer_names:
                for adapter, holder in getattr(module, attr).items():
                    params = [holder] if isinstance(holder, nn.Parameter) else list(holder.parameters())
                    found.extend((p, adapter) for p in params)
        return found

    def _apply_trainability(self) -> None:
        # peft's set_adapter makes the newly active adapter trainable; our specs are the only authority.
        for param, adapter in self._lora_params:
            param.requires_grad_(self.specs[adapter].trainable)
        for name, head in self.heads.items():
            head.requires_grad_(self.specs[name].trainable)


    # ---- switching ----------------------------------------------------------------------------
    @property
    def active_adapter(self) -> str:
        return self.peft.active_adapter

    @property
    def active(self) -> Active:
        """The active adapter's name, or the route of a routed batch."""
        return self._route if self._route is not None else self.peft.active_adapter

    @property
    def adapter_names(self) -> list[str]:
        return list(self.specs)

    def _activate(self, target: Active) -> None:
        if not isinstance(target, str):
            self._route_to(tuple(target))
            return
        name = target
        if name not in self.specs:
            raise KeyError(f"no adapter '{name}' on this model (have {self.adapter_names})")
        self._route = None
        if self.routable:
            self._single = name  # the routed LoRA layers add its outputs
        if name != self.peft.active_adapter:
            # Only pointers change. PeftModel.set_adapter walks every module and rewrites requires_grad
            # on every adapter (30 ms per switch on SmolLM2, ~7 ms even per layer), and a checkpointed
            # backward switches twice per recomputed layer; trainability is ours anyway
            # (`_apply_trainability`). Without routing, peft's layers add the active adapter's outputs.
            self._set_peft_layers(name)
            self.peft.base_model.active_adapter = name  # the LoraModel's record ...
            self.peft.active_adapter = name  # ... and the PeftModel's (peft_config lookups, saving)

    def training_pass(self):
        """Around a forward that trains (its backward may run later): what it saves for backward goes to host
        memory with --offload_activations (trainer/model/offload.py), else stays where it is."""
        return self.saved_to_host.hooks() if self.saved_to_host is not None else nullcontext()

    def checkpoint_contexts(self):
        """`context_fn` for torch.utils.checkpoint: recompute under the adapter (or route) active in the forward.

        Without it, a layer checkpointed under `value` would be recomputed in backward under whatever
        adapter is active then (usually `policy`), giving wrong gradients or a metadata mismatch.
        """
        return nullcontext(), self.use_adapter(self.active)

    def _set_peft_layers(self, name: Active) -> None:
        """What peft's own layers add: nothing on a routable model (the routed forward adds), else the active
        adapter's outputs. `_active_adapter` is what peft's set_adapter assigns (peft 0.21)."""
        adapters = [] if self.routable or not isinstance(name, str) else [name]
        for layer in self._tuner_layers:
            layer._active_adapter = adapters

    @contextmanager
    def use_adapter(self, name: Active) -> Iterator["SharedBaseModel"]:
        """Run the body with adapter `name` (or a route) active; the previous one is restored, also on exceptions."""
        previous = self.active
        self._activate(name)
        try:
            yield self
        finally:
            self._activate(previous)

    # ---- forward passes -----------------------------------------------------------------------
    @property
    def causal_lm(self) -> nn.Module:
        return self.peft.get_base_model()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, adapter: str | Sequence[str],
                output: str | Sequence[str] = "logits", keep_last: int = 0, labels: Optional[torch.Tensor] = None,
                segments: Optional[torch.Tensor] = None):
        """Only for wrappers (DDP, DeepSpeed) that must call `forward`: runs the method named by `output`.

        Code that holds the model itself calls those methods directly. Several adapters (one output
        each, "logits" or "scores") go to `fused` and give a tuple.
        """
        if not isinstance(adapter, str):
            return self.fused(input_ids, attention_mask, adapter, output, keep_last)
        passes = {
            "logits": lambda: self.logits(input_ids, attention_mask, adapter, keep_last),
            "scores": lambda: self.scores(input_ids, attention_mask, adapter, keep_last),
            "hidden": lambda: self.hidden_states(input_ids, attention_mask, adapter, keep_last),
            "logprobs": lambda: self.label_logprobs(input_ids, attention_mask, adapter, labels),
            "pair_scores": lambda: self.pair_scores(input_ids, segments, adapter),
            "pair_logprobs": lambda: self.pair_logprobs(input_ids, segments, adapter, labels),
        }
        if output not in passes:
            raise ValueError(f"unknown output '{output}': use one of {', '.join(passes)}")
        return passes[output]()

    # ---- parameters, saving -------------------------------------------------------------------
    def trainable_parameters(self) -> list[nn.Parameter]:
        """The LoRA weights of trainable adapters and their heads: exactly what the optimizer gets."""
        params = [p for p, a in self._lora_params if self.specs[a].trainable]
        for name, head in self.heads.items():
            if self.specs[name].trainable:
                params.extend(head.parameters())
        return params

    def save_adapter(self, name: str, out_dir: str | os.PathLike) -> Path:
        """Write adapter `name` in PEFT's own format (plus head.safetensors), atomically, into `out_dir`."""
        out = Path(out_dir)
        with atomic_folder(out) as tmp:
            # Never the base's embeddings: peft's "auto" would add them when the folder named in the adapter's
            # recorded base_model_name_or_path has another vocabulary size.
            self.peft.save_pretrained(str(tmp / "peft"), selected_adapters=[name], save_embedding_layers=False)
            written = tmp / "peft" / name  # peft writes non-"default" adapters into a subfolder of that name
            for item in written.iterdir():
                os.replace(item, tmp / item.name)
            shutil.rmtree(tmp / "peft")  # what is left: peft's model card for the whole model
            if name in self.heads:
                self.heads[name].save(tmp / HEAD_FILE)
        return out


def head_source(spec: AdapterSpec) -> Optional[Path]:
    """The head.safetensors a spec's head loads from (None: a fresh head, allowed only where it trains)."""
    source = spec.head_from or spec.init_from
    if source is not None and (Path(source) / HEAD_FILE).is_file():
        return Path(source) / HEAD_FILE
    if spec.head_from is not None or not spec.trainable:
        # A frozen head never learns: a random one would score noise while the run looks fine.
        where = f"{Path(source) / HEAD_FILE} is missing" if source else "no saved head was given"
        raise HeadMissingError(
            f"adapter '{spec.name}' needs its trained scalar head, but {where}: pass the folder a "
            f"{'reward' if spec.name == 'reward' else spec.name} stage saved (trainer/reward.py writes "
            f"adapter_model.safetensors + {HEAD_FILE}), not an SFT or policy adapter")
    return None


def check_specs(specs: Sequence[AdapterSpec]) -> None:
    """Everything about `specs` that can be checked before a base model loads: unique names, saved
    adapter folders where named, and a saved head for every frozen head."""
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"adapter names must be unique, got {names}")
    for spec in specs:
        if spec.init_from is not None:
            check_adapter_folder(spec.init_from, f"adapter '{spec.name}'")
        if spec.head:
            head_source(spec)


def check_adapter_folder(folder: str | os.PathLike, what: str) -> None:
    """A saved PEFT adapter: adapter_config.json (a JSON object with a LoRA rank) and the weights file."""
    import json

    folder = Path(folder)
    config = folder / "adapter_config.json"
    if not config.is_file():
        raise InputError(f"{what}: {folder} is not a saved adapter (no adapter_config.json); run the stage that "
                         "produces it first, or fix the path")
    try:
        values = json.loads(config.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(f"{what}: {config} is not valid JSON ({exc})") from None
    if not isinstance(values, dict) or type(values.get("r")) is not int or values["r"] < 1:
        raise InputError(f"{what}: {config} is not a LoRA adapter config (no integer 'r' of at least 1)")
    if values.get("peft_type", "LORA") != "LORA":  # the adapter switching and the export are LoRA's
        raise InputError(f"{what}: {config} is a {values['peft_type']} adapter; only LoRA adapters can be "
                         "used")
    if not (folder / WEIGHTS_FILE).is_file():
        if (folder / PICKLED_WEIGHTS_FILE).is_file():  # unpickling it could run code: it is never opened
            raise InputError(f"{what}: {folder} holds {PICKLED_WEIGHTS_FILE}, a pickle, which can run code when "
                             f"loaded: only {WEIGHTS_FILE} is read; convert it to safetensors where you trust it")
        raise InputError(f"{what}: {folder} has adapter_config.json but no weights ({WEIGHTS_FILE})")


def read_adapter_weights(folder: str | os.PathLike) -> tuple[dict[str, torch.Tensor], Optional[dict[str, torch.Tensor]]]:
    """The LoRA tensors (and head tensors, if any) that `save_adapter` wrote into `folder`."""
    from safetensors.torch import load_file

    folder = Path(folder)
    weights = folder / WEIGHTS_FILE
    if not weights.is_file():
        raise InputError(f"{weights} is missing")
    head = folder / HEAD_FILE
    return load_file(str(weights)), (load_file(str(head)) if head.is_file() else None)


def weights_mismatch(model: "SharedBaseModel", name: str, lora: dict[str, torch.Tensor],
                     head: Optional[dict[str, torch.Tensor]]) -> Optional[str]:
    """How read weights differ from what adapter `name` (and its head) holds: a tensor missing, extra or of
    another shape, said in a few words; None when they fit exactly (nothing is loaded here)."""
    from peft import get_peft_model_state_dict

    def shapes(tensors: Mapping[str, torch.Tensor]) -> dict[str, list[int]]:
        return {k.removeprefix("base_model.model."): list(v.shape) for k, v in tensors.items()}

    mine = get_peft_model_state_dict(model.peft, adapter_name=name, save_embedding_layers=False)
    pairs = [(shapes(lora), shapes(mine))]
    if name in model.heads:
        pairs.append(({f"head {k}": s for k, s in shapes(head or {}).items()},
                      {f"head {k}": s for k, s in shapes(model.heads[name].state_dict()).items()}))
    for saved, wanted in pairs:
        for key in sorted(set(saved) | set(wanted)):
            if key not in saved:
                return f"no saved {key} ({len(saved)} tensors saved, {len(wanted)} here)"
            if key not in wanted:
                return f"{key} saved, a weight this model does not have"
            if saved[key] != wanted[key]:
                return f"{key} is {saved[key]} saved, {wanted[key]} here"
    return None


def apply_adapter_weights(model: "SharedBaseModel", name: str, lora: dict[str, torch.Tensor],
                          head: Optional[dict[str, torch.Tensor]], source: str | os.PathLike = "") -> None:
    """Copy read weights into the existing adapter `name` (and its head), in place.

    In place, so an optimizer built over these parameters keeps pointing at them (resume).
    """
    from peft import set_peft_model_state_dict

    result = set_peft_model_state_dict(model.peft, lora, adapter_name=name)
    unexpected = [k for k in getattr(result, "unexpected_keys", []) if "lora_" in k]
    if unexpected:
        raise InputError(f"{source}: weights that fit no layer of adapter '{name}': {unexpected[:3]}")
    if name in model.heads:
        if head is None:
            raise InputError(f"{Path(source) / HEAD_FILE} is missing: adapter '{name}' has a scalar head")
        model.heads[name].load_state_dict(head)


def _set_dropout(peft_model, adapter: str, rate: float) -> None:
    from peft.tuners.lora import LoraLayer

    for module in peft_model.modules():
        if isinstance(module, LoraLayer) and adapter in module.lora_dropout:
            module.lora_dropout[adapter] = nn.Dropout(rate) if rate > 0 else nn.Identity()


def build_shared_model(args: ModelArguments, specs: list[AdapterSpec], vocab_size: Optional[int] = None,
                       device: Optional[torch.device] = None, quant_storage: torch.dtype = torch.uint8,
                       plan: Optional[RunPlan] = None) -> SharedBaseModel:
    """Load the base per `args` as `plan` settled them (a run's `RunPlan`; by default `model_plan`) and put the
    adapters of `specs` on it (`quant_storage`: see load_base_model)."""
    from trainer.model.compiled import compile_layers
    from trainer.model.loading import enable_checkpointing, load_base_model, model_plan, pick_device

    check_specs(specs)  # a wrong adapter folder stops here, before the base model loads
    device = device or pick_device()
    plan = plan or model_plan(args, device)
    base = load_base_model(args, vocab_size=vocab_size, device=device, quant_storage=quant_storage,
                           checkpointing=False, plan=plan)
    torch.manual_seed(args.model_seed)
    model = SharedBaseModel.from_specs(base, args, specs)
    if plan.gradient_checkpointing:
        enable_checkpointing(base, context_fn=model.checkpoint_contexts)
    if plan.compile_layers:
        model.compiled_parts = compile_layers(base)
    if plan.offload_activations:
        if next(base.parameters()).device.type == "cuda":
            model.saved_to_host = SavedToHost(model.parameters())
        else:
            logger.info("offload_activations ignored: the model is on the CPU, host memory already")
    n_train = sum(p.numel() for p in model.trainable_parameters())
    logger.info("adapters %s on one base; %s trainable parameters",
                ", ".join(f"{s.name}{'*' if s.trainable else ''}" for s in specs), f"{n_train:,}")
    return model