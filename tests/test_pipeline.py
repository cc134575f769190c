"""The one-command pipeline on the tiny recipe: every stage, the comparison, the report, resume - on rows in TRL's
conversational format made from the shared hh-rlhf rows, rendered with SmolLM2's chat template (the tiny preset
borrows SmolLM2's tokenizer and its template)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import torch
from conftest import in_process
from test_bad_rows import one_line_error
from test_formats import conversational

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "tests" / "configs" / "tiny_recipe"
STAGES = ("sft", "reward", "ppo", "grpo", "rloo", "dpo")


def chat_rows(run_dir: Path) -> str:
    """The --overrides that train on the conversational rows beside `run_dir` (chat.jsonl)."""
    return f"dataset={run_dir.parent / 'chat.jsonl'},data_format=conversational,chat_template=auto,max_length=160"


def pipeline(run_dir: Path) -> dict:
    """`python -m trainer.pipeline` on the tiny recipe, every stage, in this process (as it runs its stages)."""
    return in_process("trainer.pipeline", ["--recipe", str(RECIPE), "--run_dir", str(run_dir), "--with_dpo", "true",
                                           "--algorithm", "ppo,grpo,rloo", "--overrides", chat_rows(run_dir),
                                           "--eval_prompts", "4", "--eval_max_new_tokens", "6"])


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, shared_data) -> Path:
    """The pipeline's run on 400 helpful-base rows, conversational with and without an explicit prompt."""
    out = tmp_path_factory.mktemp("pipeline") / "run"
    source, chat = shared_data / "helpful-base" / "test.jsonl.gz", out.parent / "chat.jsonl"
    with gzip.open(source, "rt") as f, chat.open("w") as rows:
        for i, line in enumerate(f):
            if i >= 400:
                break
            rows.write(json.dumps(conversational(json.loads(line), implicit=i % 2 == 0)) + "\n")
    pipeline(out)
    return out


def test_pipeline_runs_every_stage_and_feeds_each_the_previous_adapters(run_dir):
    for stage in STAGES:
        results = json.loads((run_dir / stage / "results.json").read_text())
        assert results["stage"] == {"rloo": "grpo"}.get(stage, stage) and results["seconds"] > 0
        assert (run_dir / stage / "adapter" / "adapter_config.json").is_file()
    reward_cfg = json.loads((run_dir / "reward" / "config.json").read_text())
    assert reward_cfg["stage"]["sft_adapter"] == str(run_dir / "sft" / "adapter")
    for online in ("ppo", "grpo", "rloo"):  # every online RL stage starts from the same two adapters
        cfg = json.loads((run_dir / online / "config.json").read_text())["stage"]
        assert cfg["reward_adapter"] == str(run_dir / "reward" / "adapter")
        assert cfg["sft_adapter"] == str(run_dir / "sft" / "adapter")
    advantages = [json.loads((run_dir / s / "config.json").read_text())["stage"]["advantage"] for s in ("grpo", "rloo")]
    assert advantages == ["grpo", "rloo"]


def test_every_stage_trains_on_the_conversational_rows_and_the_comparison_prompts_are_templated(run_dir):
    for stage in STAGES:
        assert (run_dir / stage / "adapter" / "adapter_model.safetensors").is_file(), stage
        assert json.loads((run_dir / stage / "config.json").read_text())["data"]["data_format"] == "conversational"
    samples = json.loads((run_dir / "comparison.json").read_text())["samples"]
    assert samples and all(s["prompt"].endswith("<|im_start|>assistant\n") for s in samples)


def test_comparison_scores_every_policy_and_the_report_shows_it(run_dir):
    import math

    comparison = json.loads((run_dir / "comparison.json").read_text())
    policies = comparison["policies"]
    assert set(policies) == {"sft", "ppo", "grpo", "rloo", "dpo"}
    assert policies["sft"]["win_rate_vs_sft"] == 0.5  # against itself: all ties
    assert policies["sft"]["kl_to_sft"] == 0.0
    assert comparison["prompts"] == 4 and len(comparison["samples"]) == 4
    for name in ("ppo", "grpo", "rloo", "dpo"):  # trained policies: real scores, moved away from SFT, non-empty responses
        row = policies[name]
        assert all(math.isfinite(row[k]) for k in ("mean_score", "std_score", "win_rate_vs_sft", "kl_to_sft")), row
        # The KL is a sample estimate: after two tiny steps it is near 0 and may come out either side of it,
        # but only a policy equal to SFT gives exactly 0 (as the SFT row does).
        assert row["kl_to_sft"] != 0.0 and row["mean_length"] > 0 and 0 <= row["win_rate_vs_sft"] <= 1, row
        assert any(sample[name] for sample in comparison["samples"])
    report = (run_dir / "report.md").read_text()
    assert "win rate vs SFT" in report and "![training curves](curves.png)" in report
    for name, row in policies.items():  # the report's table holds exactly the file's numbers
        line = (f"| {name} | {row['mean_score']:.4f} | {row['win_rate_vs_sft']:.3f} | {row['kl_to_sft']:.3f} | "
                f"{row['mean_length']:.1f} |")
        assert line in report, line
    stage_seconds = [json.loads((run_dir / s / "results.json").read_text())["seconds"]
                     for s in STAGES]
    total = sum(stage_seconds) + comparison["seconds"]
    assert comparison["seconds"] > 0 and f"stages and comparison together {total:.0f} s" in report
    assert "DPO starts with the policy equal to the reference" in report  # why its accuracy before is 0
    timed = [line.split(" | ")[0] for line in report.splitlines() if line.startswith("| ") and " (s) " not in line
             and line.count("%)") == 2]  # the RL step table's rows: rollout and update with their shares
    assert timed == ["| ppo", "| grpo", "| rloo"]
    from PIL import Image

    with Image.open(run_dir / "curves.png") as image:
        assert image.size[0] > 1000


def test_a_second_run_skips_finished_stages(run_dir, capsys):
    before = (run_dir / "ppo" / "results.json").stat().st_mtime_ns
    capsys.readouterr()
    pipeline(run_dir)
    said = capsys.readouterr()
    assert said.err.count("done already") + said.out.count("done already") == len(STAGES)
    assert (run_dir / "ppo" / "results.json").stat().st_mtime_ns == before


def test_a_rerun_with_other_settings_does_not_reuse_finished_stages(run_dir, capsys):
    before = (run_dir / "sft" / "results.json").read_text()
    overrides = chat_rows(run_dir) + ",max_steps=3,learning_rate=0.01"
    code, line = one_line_error("trainer.pipeline", ["--recipe", str(RECIPE), "--run_dir", str(run_dir), "--with_dpo",
                                                     "true", "--overrides", overrides], capsys)
    assert code == 2, line
    assert f"stage sft in {run_dir / 'sft'} was finished with other settings" in line
    assert "train.max_steps: 2 -> 3" in line and "train.learning_rate: 0.002 -> 0.01" in line
    assert (run_dir / "sft" / "results.json").read_text() == before


def test_dpo_loss_on_a_batch_matches_the_formula_by_hand(run_dir, smol_tokenizer, shared_data):
    """The DPO stage's loss equals -log sigmoid(beta * margin) computed from separate log-prob passes."""
    import math

    from foundation.settings import DataArguments
    from trainer.data.collators import PairCollator
    from trainer.data.hh_rlhf import load_pairs
    from trainer.data.tokenization import tokenize_pairs
    from trainer.dpo import DPOArguments, dpo_terms
    from trainer.engine.setup import base_model_args
    from trainer.model.shared_base import AdapterSpec, build_shared_model

    adapter = run_dir / "dpo" / "adapter"
    model_args = base_model_args(adapter, gradient_checkpointing=False)
    model = build_shared_model(model_args, [AdapterSpec("policy", init_from=str(adapter)),
                                            AdapterSpec("reference", init_from=str(run_dir / "sft" / "adapter"))],
                               vocab_size=len(smol_tokenizer)).eval()
    data_args = DataArguments(dataset=str(shared_data / "helpful-base"), max_length=96, min_prompt_tokens=4)
    pairs, _ = load_pairs(data_args)
    examples, _ = tokenize_pairs(pairs[:3], smol_tokenizer, data_args)
    batch = PairCollator(smol_tokenizer.pad_token_id)(examples)
    args = DPOArguments(beta=0.5)
    with torch.no_grad():
        losses_of_stage, *_ = dpo_terms(model, batch, args)  # what the DPO stage's step body backpropagates

    def seq_logprob(adapter_name, ids, n_prompt):
        t = torch.tensor([ids])
        logits = model(t, torch.ones_like(t), adapter=adapter_name)[0].log_softmax(-1)
        return sum(logits[i - 1, ids[i]].item() for i in range(n_prompt, len(ids)))

    losses = []
    for ex in examples:
        c, r = ex.prompt_ids + ex.chosen_ids, ex.prompt_ids + ex.rejected_ids
        n = len(ex.prompt_ids)
        margin = (seq_logprob("policy", c, n) - seq_logprob("reference", c, n)) - \
                 (seq_logprob("policy", r, n) - seq_logprob("reference", r, n))
        losses.append(-math.log(1 / (1 + math.exp(-args.beta * margin))))
    assert float(losses_of_stage.mean()) == pytest.approx(sum(losses) / len(losses), rel=1e-4, abs=1e-6)


def test_evaluate_dpo_on_the_runs_eval_split_reproduces_the_stages_final_evaluation(run_dir, capsys):
    """`evaluate dpo --split eval` finds the reference (the run's SFT adapter), the split and beta from
    the run's config.json, and scores the same pairs the DPO stage evaluated at its last step."""
    capsys.readouterr()
    in_process("trainer.evaluate", ["dpo", "--adapter", str(run_dir / "dpo" / "adapter"), "--split", "eval",
                                    "--batch_size", "4", "--output_file", str(run_dir / "dpo" / "evaluation-eval.json")])
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    saved = json.loads((run_dir / "dpo" / "evaluation-eval.json").read_text())
    assert saved.pop("provenance")["git_revision"] and saved == line
    final = json.loads((run_dir / "dpo" / "results.json").read_text())["eval_after"]
    assert line["task"] == "dpo" and line["split"] == "eval"
    assert line["reference"] == str(run_dir / "sft" / "adapter")
    assert line["pairs"] == final["eval/pairs"] > 0
    assert line["rewards/accuracies"] == pytest.approx(final["eval/rewards/accuracies"])
    assert line["rewards/margins"] == pytest.approx(final["eval/rewards/margins"], rel=1e-4, abs=1e-6)
    low, high = line["accuracy_ci95"]
    assert 0.0 <= low <= line["rewards/accuracies"] <= high <= 1.0


def test_evaluate_split_without_a_run_config_names_what_to_do(run_dir, tmp_path, capsys, fresh_accelerate_state):
    import shutil

    lone = tmp_path / "adapter"
    shutil.copytree(run_dir / "dpo" / "adapter", lone)
    code, line = one_line_error("trainer.evaluate", ["dpo", "--adapter", str(lone), "--split", "eval"], capsys)
    assert code != 0
    assert "config.json does not exist: use --split all --data PATH" in line


@pytest.mark.parametrize("stage", ["ppo", "grpo"])
def test_online_rl_with_an_absent_earlier_stage_names_it_and_the_command_that_makes_it(tmp_path, stage, capsys,
                                                                                      fresh_accelerate_state):
    """A stage script trains only its own stage: an absent SFT adapter stops the run at start, in one line."""
    sft = tmp_path / "sft" / "adapter"
    code, line = one_line_error(f"trainer.{stage}", ["--config", str(RECIPE / f"{stage}.yaml"), "--output_dir",
                                                     str(tmp_path / stage), "--sft_adapter", str(sft)], capsys)
    assert code == 1 and str(sft) in line
    assert "python -m trainer.pipeline" in line
    assert f"trainer/sft.py --config trainer/configs/sft.yaml --output_dir {sft.parent}" in line
    assert not (tmp_path / "sft").exists()


def test_a_stage_run_in_process_leaves_no_model_behind_for_the_next(shared_data, tmp_path):
    """The pipeline runs its stages in one process: a finished stage's model (held in reference cycles) is freed
    before the next stage builds its own, not whenever the garbage collector next runs (on a GPU the reward
    stage measured the SFT stage's 4-bit base beside its own)."""
    import gc

    from trainer.config import PIPELINE_STAGES
    from trainer.model.shared_base import SharedBaseModel
    from trainer.pipeline import run_stage

    def models() -> list:
        found = []
        for o in gc.get_objects():
            try:
                if isinstance(o, SharedBaseModel):
                    found.append(o)
            except ReferenceError:  # a weak proxy whose object is gone: isinstance asks the object
                pass
        return found

    others = {id(o) for o in models()}  # other tests' fixtures
    module, _, fixed = PIPELINE_STAGES["sft"]
    out = tmp_path / "sft"
    run_stage("sft", ["--config", str(ROOT / "tests" / "configs" / "tiny_sft.yaml"), "--output_dir", str(out),
                      "--dataset", str(shared_data), "--max_steps", "1", "--save_every", "0", "--eval_every", "0",
                      *(a for key, value in fixed.items() for a in (f"--{key}", value))], out, module)
    assert (out / "results.json").is_file()
    assert not [o for o in models() if id(o) not in others]

