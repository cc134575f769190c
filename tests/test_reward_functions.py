"""Reward functions (--reward_fn, TRL's convention) and prompt-only datasets whose other columns reach them."""

from __future__ import annotations

import json
import math
import re
import statistics
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
TINY_GRPO = ROOT / "tests" / "configs" / "tiny_grpo.yaml"
TINY_PPO = ROOT / "tests" / "configs" / "tiny_ppo.yaml"

# Each call appends what it saw and returned to calls.jsonl beside the file.
REWARDS = '''
import json
from pathlib import Path

CALLS = Path(__file__).with_name("calls.jsonl")


def text_length(prompts, completions, completion_ids, answer, **columns):
    texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
    values = [float(len(t)) for t in texts]
    with CALLS.open("a") as f:
        f.write(json.dumps({"prompts": prompts, "completions": completions, "answer": answer, "values": values,
                            "ids": completion_ids, "columns": sorted(columns)}) + "\\n")
    return values
'''


def write_rewards(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "rewards.py"
    path.write_text(REWARDS)
    return path


def calls_of(rewards: Path) -> list[dict]:
    return [json.loads(line) for line in rewards.with_name("calls.jsonl").read_text().splitlines()]


def prompt_only_file(path: Path, rows: int, conversational: bool) -> Path:
    """Rows {"prompt": ..., "answer": "answer-i"}, the i also in the prompt, so a test can pair them."""
    lines = []
    for i in range(rows):
        question = f"Question {i}: count to {i % 7}."
        prompt = [{"role": "user", "content": question}] if conversational else question
        lines.append(json.dumps({"prompt": prompt, "answer": f"answer-{i}", "level": i % 3}))
    path.write_text("\n".join(lines) + "\n")
    return path


def step_metrics(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "rewards/text_length/mean" in r]


def question_number(prompt) -> str:
    text = prompt if isinstance(prompt, str) else prompt[0]["content"]
    return text.split(":")[0].split()[-1]


def models_built(monkeypatch, stage) -> dict:
    """{"model": the model `stage.main` builds}, once it has run."""
    built, original = {}, stage.build_model
    monkeypatch.setattr(stage, "build_model", lambda ctx: built.setdefault("model", original(ctx)))
    return built


def test_a_reward_function_from_a_file_drives_a_tiny_grpo_run_on_prompt_only_rows(tmp_path, capsys, monkeypatch,
                                                                                   fresh_accelerate_state):
    """Plain prompts + an `answer` column: each of a prompt's 4 responses gets that prompt's answer, the logged
    mean is the mean of what the function returned, and GRPO holds policy + reference only."""
    import trainer.grpo as grpo

    rewards = write_rewards(tmp_path / "fns")
    data = prompt_only_file(tmp_path / "prompts.jsonl", 40, conversational=False)
    built = models_built(monkeypatch, grpo)
    grpo.main(["--config", str(TINY_GRPO), "--output_dir", str(tmp_path / "run"), "--dataset", str(data),
               "--ppo_size", "32", "--eval_prompts", "0", "--scripted_reward", "null",
               "--reward_fn", f"{rewards}:text_length"])
    assert built["model"].adapter_names == ["policy", "reference"]
    (call,) = calls_of(rewards)
    assert len(call["values"]) == 16 and call["columns"] == ["level", "trainer_state"]  # 4 prompts x 4 responses
    assert all(isinstance(c, str) for c in call["completions"])
    for k in range(0, 16, 4):  # a prompt's responses are consecutive rows, each with the prompt's own columns
        assert len(set(call["prompts"][k : k + 4])) == 1 and len(set(call["answer"][k : k + 4])) == 1
    assert all(a == f"answer-{question_number(p)}" for p, a in zip(call["prompts"], call["answer"]))
    (step,) = step_metrics(tmp_path / "run")
    assert step["rewards/text_length/mean"] == pytest.approx(statistics.fmean(call["values"]))
    assert step["rewards/text_length/std"] == pytest.approx(statistics.stdev(call["values"]))
    assert step["objective/scores"] == pytest.approx(statistics.fmean(call["values"]))
    assert f"imported from: {rewards}" in capsys.readouterr().out


def test_a_reward_function_drives_a_tiny_ppo_run_on_conversational_prompts_without_a_reward_adapter(
        tmp_path, monkeypatch, fresh_accelerate_state):
    """Conversational prompt-only rows: the function gets the prompt messages and each completion as an
    assistant message, as TRL passes them; PPO keeps its value adapter and needs no reward adapter. The
    held-out evaluation scores with the same function, its rows' columns with it."""
    import trainer.ppo as ppo

    rewards = write_rewards(tmp_path / "fns")
    data = prompt_only_file(tmp_path / "chat.jsonl", 40, conversational=True)
    built = models_built(monkeypatch, ppo)
    ppo.main(["--config", str(TINY_PPO), "--output_dir", str(tmp_path / "run"), "--dataset", str(data),
              "--ppo_size", "32", "--max_steps", "1", "--save_every", "0", "--scripted_reward", "null",
              "--reward_fn", f"{rewards}:text_length"])
    assert built["model"].adapter_names == ["policy", "reference", "value"]
    calls = calls_of(rewards)
    rollouts = [c for c in calls if len(c["values"]) == 8]  # rollout_batch_size 8; evaluations score 4 rows
    assert len(rollouts) == 1 and len(calls) == 5  # evaluation before and after: policy and SFT each
    for call in calls:
        assert all(isinstance(p, list) and p[0]["role"] == "user" for p in call["prompts"])
        assert all(c[0]["role"] == "assistant" and len(c) == 1 for c in call["completions"])
        assert all(a == f"answer-{question_number(p)}" for p, a in zip(call["prompts"], call["answer"]))
    (step,) = step_metrics(tmp_path / "run")
    assert step["rewards/text_length/mean"] == pytest.approx(statistics.fmean(rollouts[0]["values"]))
    assert step["objective/scores"] == pytest.approx(statistics.fmean(rollouts[0]["values"]))


# ---- the scorer, unit by unit --------------------------------------------------------------------------

def batch(tok, texts: list[str], prompt: str = "Question 1: say hi."):
    """(input_ids, attention_mask, prompt_length, response_mask) of `texts` after one prompt."""
    prompt_ids = tok([prompt], add_special_tokens=False)["input_ids"][0]
    rows = [tok([t], add_special_tokens=False)["input_ids"][0] for t in texts]
    width = max(len(r) for r in rows)
    ids = torch.tensor([prompt_ids + r + [tok.pad_token_id] * (width - len(r)) for r in rows])
    rmask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    att = torch.cat([torch.ones(len(rows), len(prompt_ids), dtype=torch.long), rmask], dim=1)
    return ids, att, len(prompt_ids), rmask


def examples(n: int, **columns):
    from trainer.data.tokenization import PromptExample

    return [PromptExample([1], f"data.jsonl:{i + 1}", {"prompt": "Question 1: say hi.",
                                                        **{k: v[i] for k, v in columns.items()}}) for i in range(n)]


def scorer_of(tmp_path, tok, code: str, reward_fn: str, **settings):
    from foundation.settings import RolloutArguments
    from trainer.rl.settings import make_scorer

    (tmp_path / "fns.py").write_text(code)
    spec = ",".join(f"{tmp_path / 'fns.py'}:{name}" for name in reward_fn.split(","))
    return make_scorer(RolloutArguments(reward_fn=spec, **settings), tok)


def test_weights_sum_the_functions_and_the_reward_adapter_and_none_counts_zero(tmp_path, smol_tokenizer):
    """score = adapter (weight 1) + 2 x first + (-0.5) x second; the first's None is 0 in the sum and left out
    of its mean and std; the extra column `answer` reaches the function."""
    code = ("def first(completions, answer, **_):\n"
            "    return [1.0 if a == 'yes' else None for a in answer]\n"
            "def second(completions, **_):\n"
            "    return [3.0, 4.0]\n")
    scorer = scorer_of(tmp_path, smol_tokenizer, code, "first,second", reward_weights="2,-0.5",
                       reward_adapter="some/reward/adapter")
    assert scorer.adapter == "reward" and [f.weight for f in scorer.functions] == [2.0, -0.5]
    ids, att, p, rmask = batch(smol_tokenizer, [" Hi there.", " No."])
    adapter_scores = torch.tensor([0.5, -1.0])
    scores, metrics = scorer.score(None, ids, att, p, rmask, examples(2, answer=["yes", "no"]), adapter_scores)
    assert scores.tolist() == pytest.approx([0.5 + 2 * 1.0 - 0.5 * 3.0, -1.0 + 0.0 - 0.5 * 4.0])
    assert metrics == pytest.approx({"rewards/first/mean": 1.0, "rewards/first/std": 0.0,
                                     "rewards/second/mean": 3.5, "rewards/second/std": statistics.stdev([3, 4])})
    without = scorer_of(tmp_path, smol_tokenizer, code, "second")  # no adapter: the function alone
    assert without.adapter is None
    assert without(None, ids, att, p, rmask, examples(2, answer=["yes", "no"])).tolist() == [3.0, 4.0]


def test_a_function_that_never_applies_is_said_once_and_logs_no_nan(tmp_path, smol_tokenizer, caplog):
    """A function returning None for every row: no mean is logged for it (it wrote NaN, not JSON), one warning
    says so; a row no function scored is 0 for PPO and NaN for GRPO (`nan_unscored`), as TRL marks it."""
    import logging

    code = ("def never(completions, **_):\n    return [None] * len(completions)\n"
            "def some(completions, **_):\n    return [1.0, None]\n")
    ids, att, p, rmask = batch(smol_tokenizer, [" Hi.", " No."])
    scorer = scorer_of(tmp_path, smol_tokenizer, code, "never")
    with caplog.at_level(logging.WARNING, logger="trainer.rl.rewards"):
        for _ in range(2):
            scores, metrics = scorer.score(None, ids, att, p, rmask, examples(2))
            assert scores.tolist() == [0.0, 0.0] and metrics == {}
    said = [r.getMessage().split(" (")[0] for r in caplog.records if r.name == "trainer.rl.rewards"]
    assert said == ["reward function never"]
    both = scorer_of(tmp_path, smol_tokenizer, code, "never,some")
    scores, metrics = both.score(None, ids, att, p, rmask, examples(2), nan_unscored=True)
    assert scores[0].item() == 1.0 and math.isnan(scores[1].item()) and set(metrics) == {"rewards/some/mean",
                                                                                         "rewards/some/std"}


def test_a_trl_function_that_names_trainer_state_gets_the_step(tmp_path, smol_tokenizer):
    from trainer.rl.reward_worker import TrainerState

    code = "def staged(completions, trainer_state, **_):\n    return [float(trainer_state.global_step)] * len(completions)\n"
    scorer = scorer_of(tmp_path, smol_tokenizer, code, "staged")
    scorer.trainer_state = TrainerState(global_step=7, max_steps=10, epoch=0.5)
    ids, att, p, rmask = batch(smol_tokenizer, [" Hi.", " No."])
    assert scorer(None, ids, att, p, rmask, examples(2)).tolist() == [7.0, 7.0]
    assert scorer(None, ids, att, p, rmask).tolist() == [7.0, 7.0]  # no dataset rows at hand


def test_built_ins_and_imported_functions_score_alike_and_share_names_apart(tmp_path, smol_tokenizer):
    """--scripted_reward and --reward_fn's built-ins are the same functions; two of one name log apart."""
    from foundation.settings import RolloutArguments
    from trainer.rl.settings import make_scorer

    ids, att, p, rmask = batch(smol_tokenizer, [" Thank you.", " No."])
    scorer = make_scorer(RolloutArguments(reward_fn="keyword:you,length:2", scripted_reward="length:4"),
                         smol_tokenizer)
    assert [f.name for f in scorer.functions] == ["keyword", "length", "length_2"]
    lengths = rmask.sum(1).tolist()
    scores, metrics = scorer.score(None, ids, att, p, rmask)
    expected = [float(t == 0) - abs(n - 2) / 2 - abs(n - 4) / 4 for t, n in enumerate(lengths)]
    assert scores.tolist() == pytest.approx(expected)
    assert set(metrics) == {f"rewards/{n}/{s}" for n in ("keyword", "length", "length_2") for s in ("mean", "std")}


def test_a_module_path_and_a_file_path_import_the_arithmetic_tasks_functions(smol_tokenizer):
    """package.module:NAME and PATH.py:NAME; conversational rows get their completions as assistant messages."""
    from foundation.settings import RolloutArguments
    from trainer.rl.settings import make_scorer

    scorer = make_scorer(RolloutArguments(reward_fn="benchmarks.arithmetic.rewards:correct,"
                                                    f"{ROOT / 'benchmarks' / 'arithmetic' / 'rewards.py'}:formatted"),
                         smol_tokenizer)
    assert [(f.name, f.origin) for f in scorer.functions] == [
        ("correct", "benchmarks.arithmetic.rewards"), ("formatted", str(ROOT / "benchmarks" / "arithmetic" / "rewards.py"))]
    ids, att, p, rmask = batch(smol_tokenizer, [" 3 + 4 = 7\nAnswer: 7", " Answer: 8", " seven"])
    rows = examples(3, answer=["7", "7", "7"])
    rows = [type(e)(e.prompt_ids, e.source, {**e.columns, "prompt": [{"role": "user", "content": "3 + 4?"}]})
            for e in rows]
    scores, metrics = scorer.score(None, ids, att, p, rmask, rows)
    assert scores.tolist() == [2.0, 1.0, 0.0]
    assert metrics["rewards/correct/mean"] == pytest.approx(1 / 3) and metrics["rewards/formatted/mean"] == 2 / 3


BAD = {  # case: (code, function, what the one line says)
    "raises": ("def f(completions, **_):\n    return [1 / len(c) for c in completions]\n", "f",
               r"reward function f \(.*fns.py\) raised ZeroDivisionError: division by zero on row data.jsonl:2$"),
    "wrong count": ("def f(completions, **_):\n    return [1.0]\n", "f",
                    r"reward function f \(.*\) returned 1 values for 2 completions \(rows data.jsonl:1 ...\)$"),
    "not a list": ("def f(completions, **_):\n    return 1.0\n", "f",
                   r"reward function f \(.*\) returned float, not a list of 2 values"),
    "non-number": ("def f(completions, **_):\n    return [1.0, 'high']\n", "f",
                   r"reward function f \(.*\) returned str 'high', not a number, for row data.jsonl:2$"),
    "nan": ("def f(completions, **_):\n    return [float('nan'), 1.0]\n", "f",
            r"reward function f \(.*\) returned nan for row data.jsonl:1$"),
    "import fails": ("import no_such_module_here\n", "f",
                     r"--reward_fn '.*fns.py:f': cannot import .*fns.py: ModuleNotFoundError: No module named "
                     r"'no_such_module_here'$"),
    "syntax error": ("def f(:\n", "f", r"cannot import .*fns.py: SyntaxError: "),
    "no such function": ("def g(**_):\n    return []\n", "f", r"--reward_fn '.*fns.py:f': .*fns.py has no function f$"),
    # what a float32 score cannot hold, and a function that exits (issue 44: both passed or ended the run silently)
    "past float32": ("def f(completions, **_):\n    return [1.0, 1e308]\n", "f",
                     r"reward function f \(.*\) returned 1e\+308, past float32's range, for row data.jsonl:2$"),
    "an int past any float": ("def f(completions, **_):\n    return [10 ** 400, 1]\n", "f",
                              r"reward function f \(.*\) returned 1000.*\.\.\., past float32's range, for row "
                              r"data.jsonl:1$"),
    "exits": ("import sys\ndef f(completions, **_):\n    sys.exit(0)\n", "f",
              r"reward function f \(.*\) raised SystemExit: 0 on row data.jsonl:1$"),
    "exits at import": ("import sys\nsys.exit(3)\n", "f", r"cannot import .*fns.py: SystemExit: 3$"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_every_bad_function_stops_with_one_line_naming_it_and_the_row(tmp_path, smol_tokenizer, case):
    from trainer.rl.reward_worker import RewardFunctionError

    code, name, message = BAD[case]
    ids, att, p, rmask = batch(smol_tokenizer, [" Hi.", ""])  # the second response is empty
    with pytest.raises(RewardFunctionError) as raised:
        scorer_of(tmp_path, smol_tokenizer, code, name)(None, ids, att, p, rmask, examples(2))
    assert "\n" not in str(raised.value)
    assert raised.match(message)


def test_a_reward_weight_or_sum_past_the_reward_limit_stops_naming_the_function_or_the_row(tmp_path,
                                                                                           smol_tokenizer):
    """A reward float32 holds but whose square does not (its batch's std and value loss would be infinite), a
    weight that takes a value there, and a sum of two that gets there: each one line."""
    from trainer.rl.reward_worker import RewardFunctionError

    code = ("def huge(completions, **_):\n    return [10.0, -3e38]\n"
            "def big(completions, **_):\n    return [10.0, 6e14]\n"
            "def small(completions, **_):\n    return [1.0, 1.0]\n")
    ids, att, p, rmask = batch(smol_tokenizer, [" Hi.", " No."])
    with pytest.raises(RewardFunctionError, match=r"reward function huge \(.*\) returned -3e\+38, past \+-1e\+15 "
                                                  r"\(float32 variances and value losses overflow there\), for row "
                                                  r"data.jsonl:2$"):
        scorer_of(tmp_path, smol_tokenizer, code, "huge")(None, ids, att, p, rmask, examples(2))
    with pytest.raises(RewardFunctionError, match=r"reward function small \(.*\) returned 1 times its weight 1e\+300, "
                                                  r"past \+-1e\+15 .*, for row data.jsonl:1$"):
        scorer_of(tmp_path, smol_tokenizer, code, "small", reward_weights="1e300")(None, ids, att, p, rmask,
                                                                                   examples(2))
    with pytest.raises(RewardFunctionError, match=r"the weighted rewards of row data.jsonl:2 sum past \+-1e\+15 "
                                                  r"\(big, big_2\)"):
        scorer_of(tmp_path, smol_tokenizer, code, "big,big")(None, ids, att, p, rmask, examples(2))


def test_a_function_past_its_time_limit_stops_the_run_naming_it(tmp_path, smol_tokenizer):
    import time

    from trainer.rl.reward_worker import RewardFunctionError

    code = "import time\ndef slow(completions, **_):\n    time.sleep(30)\n    return [0.0] * len(completions)\n"
    ids, att, p, rmask = batch(smol_tokenizer, [" Hi.", " No."])
    started = time.monotonic()
    with pytest.raises(RewardFunctionError, match=r"reward function slow \(.*\) ran past --reward_timeout_s 0.5 on "
                                                  r"the batch of rows data.jsonl:1 \.\.\.$"):
        scorer_of(tmp_path, smol_tokenizer, code, "slow", reward_timeout_s=0.5)(None, ids, att, p, rmask, examples(2))
    assert time.monotonic() - started < 5


# Reward functions that attack the process they run in. The driver scores each with its own scorer, in ONE
# process, and records what came back: a case that takes the trainer's process down leaves no record.
HOSTILE = {  # case: (code, timeout, the one line, or None where scoring goes on)
    "os._exit(0) in the function": ("import os\ndef f(completions, **_):\n    os._exit(0)\n", 60,
                                    r"reward function f \(.*\) ended its process \(exit code 0\) on the batch of rows "
                                    r"data.jsonl:1 \.\.\.$"),
    "os._exit(3) in the function": ("import os\ndef f(completions, **_):\n    os._exit(3)\n", 60,
                                    r"reward function f \(.*\) ended its process \(exit code 3\) on the batch"),
    "os._exit(0) at import": ("import os\nos._exit(0)\n", 60,
                              r"--reward_fn '.*:f': cannot import .*: its process ended \(exit code 0\) while "
                              r"importing it$"),
    "a catastrophic regex past the limit": ("import re\ndef f(completions, **_):\n"
                                            "    re.match(r'(a+)+$', 'a' * 64 + 'b')\n    return [0.0, 0.0]\n", 1,
                                            r"reward function f \(.*\) ran past --reward_timeout_s 1 on the batch"),
    "raises KeyboardInterrupt": ("def f(completions, **_):\n    raise KeyboardInterrupt\n", 60,
                                 r"reward function f \(.*\) raised KeyboardInterrupt on row data.jsonl:1$"),
    "a number whose float() raises": ("class Odd(float):\n    def __float__(self):\n        raise ValueError('no')\n"
                                      "def f(completions, **_):\n    return [1.0, Odd(2.0)]\n", 60,
                                      r"reward function f \(.*\) returned Odd 2.0 whose float\(\) raised ValueError: "
                                      r"no, for row data.jsonl:2$"),
    "closes sys.stdout": ("import sys\ndef f(completions, **_):\n    sys.stdout.close()\n    return [1.0, 2.0]\n",
                          60, None),
}

DRIVER = """
import json, sys, torch
from trainer.data.tokenization import PromptExample
from trainer.rl.rewards import RewardFunctionError
from trainer.rl.settings import RolloutArguments, make_scorer

class Tokenizer:  # decodes every row to the same text: the functions here read none
    pad_token_id = 0
    def batch_decode(self, ids, skip_special_tokens=True):
        return ["x"] * len(ids)

ids, att, rmask = torch.ones(2, 4, dtype=torch.long), torch.ones(2, 4, dtype=torch.long), torch.ones(2, 2)
rows = [PromptExample([1], f"data.jsonl:{i + 1}", {"prompt": "Hi."}) for i in range(2)]
for line in sys.stdin:
    case, path, timeout = json.loads(line)
    try:
        scorer = make_scorer(RolloutArguments(reward_fn=f"{path}:f", reward_timeout_s=timeout), Tokenizer())
        said = scorer(None, ids, att, 2, rmask, rows).tolist()
    except RewardFunctionError as exc:
        said = str(exc)
    print("alive", flush=True)  # this process's own stdout still works
    with open(sys.argv[1], "a") as out:
        out.write(json.dumps({"case": case, "said": said}) + "\\n")
"""


@pytest.fixture(scope="module")
def hostile_outcomes(tmp_path_factory) -> dict:
    import os
    import subprocess
    import sys

    folder = tmp_path_factory.mktemp("hostile")
    lines = []
    for i, (case, (code, timeout, _)) in enumerate(HOSTILE.items()):
        (folder / f"fn{i}.py").write_text(code)
        lines.append(json.dumps([case, str(folder / f"fn{i}.py"), timeout]))
    record = folder / "outcomes.jsonl"
    try:
        subprocess.run([sys.executable, "-c", DRIVER, str(record)], input="\n".join(lines) + "\n", cwd=ROOT,
                       env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:  # a case that hung the process: the cases after it have no record
        pass
    return {row["case"]: row["said"] for row in map(json.loads, record.read_text().splitlines())} \
        if record.exists() else {}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_function_that_exits_hangs_or_attacks_its_process_leaves_the_trainer_one_line(hostile_outcomes, case):
    """os._exit in the function or at import, a regex no thread can stop, KeyboardInterrupt, a float() that
    raises: each one line naming the function, the trainer's process alive; closing sys.stdout is harmless."""
    assert case in hostile_outcomes, "the trainer's process did not survive it"
    said, message = hostile_outcomes[case], HOSTILE[case][2]
    if message is None:
        assert said == [1.0, 2.0]
    else:
        assert isinstance(said, str) and "\n" not in said and re.search(message, said), said


def test_numpy_and_torch_scalars_are_rewards_as_python_numbers_are(tmp_path, smol_tokenizer):
    """`list(predictions == answers)` gives numpy bools; a torch or numpy float is a number too."""
    code = ("import numpy, torch\n"
            "def f(completions, **_):\n    return [numpy.bool_(True), numpy.float32(1.5)]\n"
            "def g(completions, **_):\n    return torch.tensor([2.0, -1.0])\n")
    ids, att, p, rmask = batch(smol_tokenizer, [" Hi.", " No."])
    assert scorer_of(tmp_path, smol_tokenizer, code, "f,g")(None, ids, att, p, rmask, examples(2)).tolist() == [3.0, 0.5]


def _gone(pid: int, within_s: float = 10.0) -> bool:
    import os
    import time

    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        try:  # a child of this process that has exited is a zombie until reaped
            if os.waitpid(pid, os.WNOHANG) != (0, 0):
                return True
        except ChildProcessError:
            pass
        time.sleep(0.1)
    return False


def test_a_function_past_its_limit_is_killed_with_what_it_started_and_a_killed_trainer_takes_its_worker(
        tmp_path, smol_tokenizer):
    """The timeout kills the worker's process group (a `sleep` the function started too); a trainer killed with
    SIGKILL leaves no worker behind."""
    import os
    import signal
    import subprocess
    import sys

    from trainer.rl.reward_worker import RewardFunctionError

    started = tmp_path / "started.pid"
    code = ("import subprocess, time\n"
            "def f(completions, **_):\n"
            f"    open({str(started)!r}, 'w').write(str(subprocess.Popen(['sleep', '1000']).pid))\n"
            "    time.sleep(1000)\n")
    ids, att, p, rmask = batch(smol_tokenizer, [" Hi.", " No."])
    with pytest.raises(RewardFunctionError, match="ran past --reward_timeout_s 2"):
        scorer_of(tmp_path, smol_tokenizer, code, "f", reward_timeout_s=2)(None, ids, att, p, rmask, examples(2))
    assert _gone(int(started.read_text()))

    (tmp_path / "idle.py").write_text("def f(completions, **_):\n    return [0.0] * len(completions)\n")
    trainer = subprocess.Popen([sys.executable, "-c", "import sys, time\n"
                                "from trainer.rl.rewards import load_reward_functions\n"
                                "(f,) = load_reward_functions([sys.argv[1]], [1.0])\n"
                                "print(f.worker.process.pid, flush=True)\ntime.sleep(1000)\n",
                                f"{tmp_path / 'idle.py'}:f"], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    worker = int(trainer.stdout.readline())
    os.kill(trainer.pid, signal.SIGKILL)
    trainer.wait()
    assert _gone(worker)


def test_a_grpo_run_whose_function_exits_the_process_stops_with_one_line_and_frees_its_folder(tmp_path):
    """os._exit(0) in a reward function: the GRPO run ends with exit code 2 and the line, no adapter, and its
    folder free (no run.lock left)."""
    import os
    import subprocess
    import sys

    (tmp_path / "fns.py").write_text("import os\ndef f(completions, **_):\n    os._exit(0)\n")
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "trainer.grpo", "--config", str(TINY_GRPO), "--output_dir", str(out),
                           "--max_steps", "1", "--save_every", "0", "--eval_every", "0", "--eval_prompts", "0",
                           "--scripted_reward", "null", "--reward_fn", f"{tmp_path / 'fns.py'}:f"], cwd=ROOT,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith(
        f"error: reward function f ({tmp_path / 'fns.py'}) ended its process (exit code 0) on the batch of rows ")
    assert not (out / "run.lock").exists() and not (out / "adapter").exists()


def test_each_function_gets_its_own_copies_of_the_rows(tmp_path, smol_tokenizer):
    """A function that edits its arguments in place changes neither what the next function sees nor the rows,
    at this step or the next."""
    code = ("def vandal(prompts, completions, answer, **_):\n"
            "    for i in range(len(prompts)):\n"
            "        prompts[i] += ' MUTATED'\n        answer[i] = 'MUTATED'\n        completions[i] = 'MUTATED'\n"
            "    prompts.append('extra')\n"
            "    return [0.0] * len(completions)\n"
            "def witness(prompts, completions, answer, **_):\n"
            "    return [float('MUTATED' in p + c + a) for p, c, a in zip(prompts, completions, answer)]\n")
    scorer = scorer_of(tmp_path, smol_tokenizer, code, "vandal,witness")
    ids, att, p, rmask = batch(smol_tokenizer, [" Hi.", " No."])
    rows = examples(2, answer=["yes", "no"])
    before = [dict(e.columns) for e in rows]
    for _ in range(2):
        assert scorer(None, ids, att, p, rmask, rows).tolist() == [0.0, 0.0]
    assert [e.columns for e in rows] == before


def test_a_missing_file_a_bad_spec_and_wrong_weights_are_refused(tmp_path):
    from foundation.cli import UsageError
    from foundation.settings import RolloutArguments
    from trainer.rl.settings import make_scorer

    with pytest.raises(UsageError, match=r"--reward_fn '.*nowhere.py:f': no such file"):
        make_scorer(RolloutArguments(reward_fn=f"{tmp_path}/nowhere.py:f"), None)
    with pytest.raises(UsageError, match=r"--reward_fn 'rewards.py': 'rewards.py': use PATH.py:NAME"):
        RolloutArguments(reward_fn="rewards.py")
    with pytest.raises(UsageError, match=r"--reward_weights '1,2': 2 weights for 1 reward functions"):
        RolloutArguments(reward_fn="pkg.mod:f", reward_weights="1,2")
    with pytest.raises(UsageError, match=r"--reward_weights 'x': use comma-separated numbers"):
        RolloutArguments(reward_fn="pkg.mod:f", reward_weights="x")


def test_a_failing_function_ends_a_grpo_run_with_one_line_and_exit_code_2(tmp_path, capsys, fresh_accelerate_state):
    import trainer.grpo as grpo
    from foundation.cli import run

    (tmp_path / "bad.py").write_text("def f(completions, **_):\n    return [float('nan')] * len(completions)\n")
    with pytest.raises(SystemExit) as exit_info:
        run(grpo.main, ["--config", str(TINY_GRPO), "--output_dir", str(tmp_path / "run"), "--eval_prompts", "0",
                        "--reward_fn", f"{tmp_path / 'bad.py'}:f"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith(f"error: reward function f ({tmp_path / 'bad.py'}) returned nan "
                                                   "for row ")


# ---- prompt-only rows --------------------------------------------------------------------------------

def parsed(record: dict, render=None):
    from trainer.data.formats import row_parser
    from trainer.data.hh_rlhf import RawRow

    return row_parser("auto", render)(RawRow("rows.jsonl:7", json.dumps(record)))


def test_prompt_only_rows_keep_their_other_columns_and_feed_only_ppo_and_grpo(smol_tokenizer):
    from foundation.settings import DataArguments
    from trainer.data.formats import ChatRenderer
    from trainer.data.tokenization import tokenize_prompts, tokenize_sft

    plain = parsed({"prompt": "What is 2 + 2?", "answer": "4"})
    assert (plain.prompt, plain.chosen, plain.rejected) == ("What is 2 + 2?", None, None)
    assert plain.columns == {"prompt": "What is 2 + 2?", "answer": "4"}
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    chat = parsed({"prompt": messages, "answer": "4"}, ChatRenderer(smol_tokenizer, "auto"))
    assert chat.prompt.endswith("<|im_start|>assistant\n") and chat.columns["prompt"] == messages
    args = DataArguments(max_length=128)
    (example, _), _ = tokenize_prompts([plain, chat], smol_tokenizer, args)
    assert example.columns == {"prompt": "What is 2 + 2?", "answer": "4"}
    examples, report = tokenize_sft([plain, chat], smol_tokenizer, args)
    assert not examples and report.no_completion == 2
    from trainer.data.hh_rlhf import DataError

    with pytest.raises(DataError, match=r"^rows.jsonl:7: no_completion: a prompt-only row has no completion"):
        tokenize_sft([plain], smol_tokenizer, DataArguments(on_bad_row="error"))


@pytest.mark.parametrize("record, message", [
    ({"prompt": 3, "answer": "4"}, r"rows.jsonl:7: not_string: 'prompt' is int, not a string"),
    ({"prompt": "  ", "answer": "4"}, r"rows.jsonl:7: no_prompt: 'prompt' is empty"),
    ({"prompt": [{"role": "robot", "content": "x"}]}, r"rows.jsonl:7: not_messages: 'prompt'\[0\] is not a"),
])
def test_a_bad_prompt_only_row_is_one_line_naming_file_and_row(record, message):
    from trainer.data.hh_rlhf import DataError

    with pytest.raises(DataError, match=message) as raised:
        parsed(record)
    assert "\n" not in str(raised.value)


def test_the_run_report_shows_each_reward_functions_mean_at_the_first_and_last_step(tmp_path):
    from trainer.run_report import reward_function_table

    (tmp_path / "grpo").mkdir()
    rows = [{"step": 1, "rewards/correct/mean": 0.25, "rewards/correct/std": 0.5, "loss": 1.0},
            {"step": 0, "eval/win_rate": 0.5},
            {"step": 3, "rewards/correct/mean": 0.75, "rewards/correct/std": 0.25, "loss": 0.5}]
    (tmp_path / "grpo" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    lines = reward_function_table(tmp_path, ["sft", "grpo"])
    assert lines[0] == "## Reward functions"
    assert "| grpo | correct | 0.25 ± 0.5 (step 1) | 0.75 ± 0.25 (step 3) |" in lines
    assert reward_function_table(tmp_path, ["sft"]) == []


def test_a_run_resumed_after_its_reward_file_changed_says_so_once(tmp_path, capsys, fresh_accelerate_state):
    """The run records a hash of each reward function's file; resuming after the file was edited warns that the
    steps before and after are scored by different functions (it resumed silently)."""
    import trainer.grpo as grpo
    from trainer.engine.launch import reset_accelerate

    rewards = write_rewards(tmp_path / "fns")
    data = prompt_only_file(tmp_path / "prompts.jsonl", 40, conversational=False)
    argv = ["--config", str(TINY_GRPO), "--output_dir", str(tmp_path / "run"), "--dataset", str(data),
            "--ppo_size", "32", "--eval_prompts", "0", "--scripted_reward", "null", "--save_every", "1",
            "--reward_fn", f"{rewards}:text_length"]
    grpo.main([*argv, "--max_steps", "1"])
    saved = json.loads((tmp_path / "run" / "config.json").read_text())["resolved"]["reward_files"]
    assert list(saved) == [str(rewards)] and len(saved[str(rewards)]) == 16
    reset_accelerate()
    capsys.readouterr()
    rewards.write_text(REWARDS.replace("float(len(t))", "float(len(t)) / 2"))
    grpo.main([*argv, "--max_steps", "2"])
    said = [line for line in capsys.readouterr().out.splitlines() if "changed since the checkpoint" in line]
    assert len(said) == 1 and f"WARNING trainer.engine.setup: reward functions in {rewards}" in said[0]


def test_a_grpo_step_with_unscored_responses_logs_finite_metrics(tmp_path, fresh_accelerate_state):
    """Half the responses unscored (every function returned None) and one function that never applies: the
    step's metrics are finite JSON (no NaN), and the unscored fraction is logged."""
    import trainer.grpo as grpo

    fns = tmp_path / "fns.py"
    fns.write_text("def half(completions, **_):\n    return [float(len(c)) if i % 2 else None for i, c in enumerate("
                   "completions)]\ndef never(completions, **_):\n    return [None] * len(completions)\n")
    data = prompt_only_file(tmp_path / "prompts.jsonl", 40, conversational=False)
    grpo.main(["--config", str(TINY_GRPO), "--output_dir", str(tmp_path / "run"), "--dataset", str(data),
               "--ppo_size", "32", "--eval_prompts", "0", "--scripted_reward", "null",
               "--reward_fn", f"{fns}:half,{fns}:never"])

    def no_nan(text):
        raise ValueError(f"{text} in metrics.jsonl")

    rows = [json.loads(line, parse_constant=no_nan) for line in (tmp_path / "run" / "metrics.jsonl").read_text()
            .splitlines()]
    step = next(r for r in rows if "frac_reward_unscored" in r)
    assert step["frac_reward_unscored"] == 0.5 and "rewards/half/mean" in step and "rewards/never/mean" not in step
