"""Compare trained policies on held-out prompts under the reward model, on one shared base.

The SFT, PPO (and DPO) policies and the reward model are adapters on ONE base: each policy samples
responses to the same held-out prompts (same seed), the `reward` adapter scores them, and each
policy's KL to the SFT policy is estimated from its own samples. Writes `comparison.json`.

    python -m trainer.compare --run_dir runs/demo [--with_dpo true]
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from trainer.collators import PromptCollator
from trainer.config import DataArguments
from trainer.data import load_splits
from trainer.models import load_tokenizer, pick_device
from trainer.rollout import RewardModelScorer, SamplingConfig, response_logprobs, sample_responses
from trainer.run import base_model_args
from trainer.shared_base import AdapterSpec, build_shared_model
from trainer.tokenization import tokenize_prompts

logger = logging.getLogger(__name__)


def policy_adapters(run_dir: Path, with_dpo: bool) -> dict[str, Path]:
    found = {"sft": run_dir / "sft" / "adapter", "ppo": run_dir / "ppo" / "adapter"}
    if with_dpo:
        found["dpo"] = run_dir / "dpo" / "adapter"
    missing = [str(p) for p in [*found.values(), run_dir / "reward" / "adapter"] if not (p / "adapter_config.json").is_file()]
    if missing:
        raise SystemExit(f"cannot compare: no adapter in {', '.join(missing)} (run the stages first)")
    return found


def held_out_prompts(run_dir: Path, tokenizer, count: int):
    """The SFT run's evaluation split: prompts no stage trained on."""
    saved = json.loads((run_dir / "sft" / "config.json").read_text())["data"]
    data_args = DataArguments(**saved)
    splits, _ = load_splits(data_args)
    prompts, _ = tokenize_prompts(splits.eval[:count], tokenizer, data_args)
    return prompts, [p.prompt for p in splits.eval[:count]]


@torch.no_grad()
def compare_policies(run_dir: Path, args, with_dpo: bool = False) -> dict[str, Any]:
    started = time.time()
    run_dir = Path(run_dir)
    adapters = policy_adapters(run_dir, with_dpo)
    model_args = base_model_args(adapters["sft"], gradient_checkpointing=False)
    tokenizer = load_tokenizer(model_args.model_name_or_path, model_args.preset_overrides,
                                   model_args.tokenizer_name_or_path)
    specs = [AdapterSpec(name, init_from=str(path)) for name, path in adapters.items()]
    specs.append(AdapterSpec("reward", init_from=str(run_dir / "reward" / "adapter"), head=True))
    device = pick_device()
    model = build_shared_model(model_args, specs, vocab_size=len(tokenizer), device=device).eval()
    prompts, texts = held_out_prompts(run_dir, tokenizer, args.eval_prompts)
    collate = PromptCollator(tokenizer.pad_token_id)
    sampling = SamplingConfig(max_new_tokens=args.eval_max_new_tokens)
    scorer = RewardModelScorer("reward")
    scores = {name: [] for name in adapters}
    kls = {name: [] for name in adapters}
    lengths = {name: [] for name in adapters}
    responses: dict[str, list[str]] = {name: [] for name in adapters}
    batch_size = 8
    for start in range(0, len(prompts), batch_size):
        batch = collate(prompts[start : start + batch_size])
        ids, mask = batch["input_ids"].to(device), batch["attention_mask"].to(device)
        for name in adapters:
            torch.manual_seed(start)  # the same sampling noise for every policy
            full, att, rmask, _ = sample_responses(model, ids, mask, sampling, tokenizer.eos_token_id,
                                                   tokenizer.pad_token_id, adapter=name)
            p = ids.shape[1]
            scores[name] += scorer(model, full, att, p, rmask).tolist()
            own, _ = response_logprobs(model, full, att, p, name)
            ref, _ = response_logprobs(model, full, att, p, "sft")
            kls[name] += ((own - ref) * rmask).sum(1).tolist()
            lengths[name] += rmask.sum(1).float().tolist()
            responses[name] += tokenizer.batch_decode(full[:, p:].masked_fill(rmask == 0, tokenizer.pad_token_id),
                                                      skip_special_tokens=True)
    result: dict[str, Any] = {"prompts": len(prompts), "sampling": asdict(sampling), "policies": {}}
    sft = torch.tensor(scores["sft"])
    for name in adapters:
        mine = torch.tensor(scores[name])
        result["policies"][name] = {
            "mean_score": mine.mean().item(), "std_score": mine.std().item(),
            "win_rate_vs_sft": ((mine > sft).float() + 0.5 * (mine == sft).float()).mean().item(),
            "kl_to_sft": float(torch.tensor(kls[name]).mean()), "mean_length": float(torch.tensor(lengths[name]).mean()),
        }
    result["samples"] = [{"prompt": texts[i], **{name: responses[name][i] for name in adapters},
                          **{f"score_{name}": scores[name][i] for name in adapters}}
                         for i in range(min(args.samples_in_report, len(prompts)))]
    result["seconds"] = time.time() - started  # the run report adds it to the stage times
    (run_dir / "comparison.json").write_text(json.dumps(result, indent=2))
    logger.info("comparison: %s", json.dumps(result["policies"]))
    return result


def main(argv=None) -> dict:
    import sys

    from transformers import HfArgumentParser

    from trainer.pipeline import PipelineArguments

    (args,) = HfArgumentParser(PipelineArguments).parse_args_into_dataclasses(
        args=list(sys.argv[1:] if argv is None else argv))
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    result = compare_policies(Path(args.run_dir), args, with_dpo=args.with_dpo)
    print(json.dumps(result["policies"]))
    return result


if __name__ == "__main__":
    main()
