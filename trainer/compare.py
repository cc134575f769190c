"""Compare trained policies on held-out prompts under the reward model, on one shared base.

The SFT policy, each online RL policy of the run (PPO, GRPO, RLOO), DPO's when asked, and the reward model are adapters on ONE base: each policy samples
responses to the same held-out prompts (same seed), the `reward` adapter scores them, and each
policy's KL to the SFT policy is estimated from its own samples (`trainer.rl.policy_eval`, which
PPO's periodic evaluation runs too). Writes `comparison.json`.

    python -m trainer.compare --run_dir runs/demo [--algorithm ppo,grpo,rloo] [--with_dpo true]
"""

from __future__ import annotations

import json
import logging
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional

from foundation.cli import InputError, UsageError, parse, parse_assignments, run
from foundation.config_files import read_yaml
from foundation.files import write_atomic
from foundation.settings import DataArguments
from foundation.stages import REWARD
from trainer.config import RECIPES, PipelineArguments
from trainer.data.formats import parser_for
from trainer.data.hh_rlhf import load_splits
from trainer.data.tokenization import tokenize_prompts
from trainer.engine.setup import base_model_args
from trainer.model.decode import Generator, Sampling
from trainer.model.loading import load_tokenizer, pick_device
from trainer.model.shared_base import AdapterSpec, build_shared_model
from trainer.rl.policy_eval import sample_policies
from trainer.rl.rewards import Scorer

logger = logging.getLogger(__name__)
SEED = 0
BATCH_SIZE = 8


def policy_adapters(run_dir: Path, args: PipelineArguments) -> dict[str, Path]:
    """policy name -> its adapter folder: SFT first (the baseline), then the run's trained policies."""
    found = {name: run_dir / name / "adapter" for name in ["sft", *args.trained_policies]}
    missing = [str(p) for p in [*found.values(), run_dir / "reward" / "adapter"] if not (p / "adapter_config.json").is_file()]
    if missing:
        raise InputError(f"cannot compare: no adapter in {', '.join(missing)} (run the stages first)")
    return found


def trusts_remote_code(args: PipelineArguments) -> bool:
    """trust_remote_code as the user's own settings give it (--overrides, else the recipe's sft.yaml), never
    as an adapter's base_model.json does."""
    given = parse_assignments(args.overrides, "overrides").get("trust_remote_code")
    if given is not None:
        if given.lower() not in ("true", "yes", "1", "false", "no", "0"):
            raise UsageError(f"--overrides: trust_remote_code={given} must be true or false")
        return given.lower() in ("true", "yes", "1")
    config = RECIPES.get(args.recipe, Path(args.recipe)) / "sft.yaml"
    model = read_yaml(config).get("model") if config.is_file() else None
    return isinstance(model, dict) and model.get("trust_remote_code") is True


def held_out_prompts(run_dir: Path, tokenizer, count: int):
    """The SFT run's evaluation split: prompts no stage trained on."""
    saved = json.loads((run_dir / "sft" / "config.json").read_text())["data"]
    data_args = DataArguments(**saved)
    splits, _ = load_splits(data_args, parser_for(data_args, tokenizer))  # rendered as the stages rendered them
    prompts, _ = tokenize_prompts(splits.eval[:count], tokenizer, data_args)
    return prompts, [p.prompt for p in splits.eval[:count]]


def compare_policies(run_dir: Path, args: PipelineArguments) -> dict[str, Any]:
    started = time.time()
    run_dir = Path(run_dir)
    adapters = policy_adapters(run_dir, args)
    model_args = base_model_args(adapters["sft"], trust_remote_code=trusts_remote_code(args),
                                 allow_with="--overrides trust_remote_code=true", gradient_checkpointing=False)
    tokenizer = load_tokenizer(model_args.model_name_or_path, model_args.preset_overrides,
                               model_args.tokenizer_name_or_path, model_args.trust_remote_code)
    specs = [AdapterSpec(name, init_from=str(path)) for name, path in adapters.items()]
    specs.append(AdapterSpec(REWARD, init_from=str(run_dir / "reward" / "adapter"), head=True))
    model = build_shared_model(model_args, specs, vocab_size=len(tokenizer), device=pick_device()).eval()
    prompts, texts = held_out_prompts(run_dir, tokenizer, args.eval_prompts)
    sampling = Sampling(max_new_tokens=args.eval_max_new_tokens)
    samples = sample_policies(Generator(model), prompts, list(adapters), "sft", Scorer(), sampling,
                              tokenizer.eos_token_id, tokenizer.pad_token_id, BATCH_SIZE, SEED, tokenizer=tokenizer)
    result: dict[str, Any] = {"prompts": len(prompts), "sampling": asdict(sampling), "policies": {}}
    for name, mine in samples.items():
        summary = mine.summary(samples["sft"])
        result["policies"][name] = {"mean_score": summary["mean_score"], "std_score": summary["std_score"],
                                    "win_rate_vs_sft": summary["win_rate"], "kl_to_sft": summary["kl"],
                                    "mean_length": summary["mean_length"]}
    result["samples"] = [{"prompt": texts[i], **{name: samples[name].responses[i] for name in adapters},
                          **{f"score_{name}": samples[name].scores[i] for name in adapters}}
                         for i in range(min(args.samples_in_report, len(prompts)))]
    result["seconds"] = time.time() - started  # the run report adds it to the stage times
    write_atomic(run_dir / "comparison.json", json.dumps(result, indent=2))
    logger.info("comparison: %s", json.dumps(result["policies"]))
    return result


def main(argv: Optional[list[str]] = None) -> dict:
    (args,) = parse([PipelineArguments], list(sys.argv[1:] if argv is None else argv))
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, force=True)
    result = compare_policies(Path(args.run_dir), args)
    print(json.dumps(result["policies"]))
    return result


if __name__ == "__main__":
    run(main)
