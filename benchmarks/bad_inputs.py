"""Every bad input of the trust-and-correctness probe, run as a user would run it: the exit code and the one
line each command prints. Writes benchmarks/results/bad_inputs/ (README.md table, result.json).

    python -m benchmarks.bad_inputs

Each case is a real command in its own process, on the tiny Llama or the embedded SmolLM2, against files in
a scratch folder. A disk filling mid-checkpoint runs on a small tmpfs where one can be mounted; a folder
filled mid-export and a kill during the final save are pinned by tests only.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from io import BytesIO
from pathlib import Path
from typing import Callable

from foundation.files import write_atomic
from foundation.provenance import PROJECT_ROOT, provenance

TINY_SFT = "tests/configs/tiny_sft.yaml"
TINY_PPO = "tests/configs/tiny_ppo.yaml"
TINY_GRPO = "tests/configs/tiny_grpo.yaml"
QUICK = ["--max_steps", "1", "--save_every", "0", "--eval_every", "0"]
PINNED_BY_TESTS = [
    ("2", "`--out` filled by another program while `trainer.export` runs",
     "tests/test_export.py::test_an_out_folder_filled_while_exporting_is_left_as_it_is_and_refused_in_one_line"),
    ("2", "a kill during the final save leaves a `.adapter-XXXX` folder",
     "tests/test_lost_runs.py::test_a_kill_during_the_final_save_leaves_debris_the_next_run_removes"),
    ("44.3", "a reward function that edits its arguments in place",
     "tests/test_reward_functions.py::test_each_function_gets_its_own_copies_of_the_rows"),
    ("44.4", "a reward function returning None for every row; a row every function leaves unscored",
     "tests/test_reward_functions.py::test_a_grpo_step_with_unscored_responses_logs_finite_metrics"),
    ("44.7", "no room for run.lock or a metrics.jsonl line; torch's iostream error on a tiny tmpfs",
     "tests/test_lost_runs.py::test_a_full_disk_at_the_lock_or_the_metrics_stops_in_one_line"),
    ("44.7", "export --out / evaluate --output_file on a read-only or full filesystem",
     "tests/test_export.py::test_an_out_link_or_an_unwritable_place_is_refused_before_the_export_starts"),
    ("44.10", "collect: a malformed memory.json, or an archive unpacking past 256 MiB",
     "tests/test_gpu_kit.py::test_collect_refuses_a_malformed_results_file_before_writing_anything"),
    ("44.11", "pipeline --overrides reward_fn=... reaching the SFT stage",
     "tests/test_config_errors.py::test_a_pipeline_override_goes_only_to_the_stages_that_have_the_setting"),
    ("44.11", "a run resumed after its reward file was edited",
     "tests/test_reward_functions.py::test_a_run_resumed_after_its_reward_file_changed_says_so_once"),
]


def hh_row(i: int) -> dict:
    return {"chosen": f"\n\nHuman: Question {i} about bread?\n\nAssistant: Mix flour and yeast, {i} times.",
            "rejected": f"\n\nHuman: Question {i} about bread?\n\nAssistant: No."}


def rows_file(path: Path, lines: list) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in lines))
    return str(path)


class Scratch:
    """The scratch folder, and the few things several cases share (made once, on first use)."""

    def __init__(self, root: Path):
        self.root = root
        self._adapter = None

    def path(self, name: str) -> Path:
        return self.root / name

    def adapter(self) -> Path:
        """A tiny SFT adapter (one step), with its base_model.json."""
        if self._adapter is None:
            out = self.root / "tiny-sft"
            subprocess.run([sys.executable, "-m", "trainer.sft", "--config", TINY_SFT, "--output_dir", str(out),
                            *QUICK], cwd=PROJECT_ROOT, check=True, capture_output=True)
            self._adapter = out / "adapter"
        return self._adapter

    def adapter_copy(self, name: str, edit: Callable[[dict], None]) -> str:
        """A copy of the tiny adapter whose base_model.json `edit` changed."""
        folder = self.root / name
        shutil.copytree(self.adapter(), folder)
        record = json.loads((folder / "base_model.json").read_text())
        edit(record)
        (folder / "base_model.json").write_text(json.dumps(record))
        return str(folder)

    def archive(self, name: str, manifest) -> str:
        """A GPU-kit archive whose memory/manifest.json is `manifest` (JSON, or bytes as they are)."""
        data = manifest if isinstance(manifest, bytes) else json.dumps(manifest).encode()
        path = self.root / f"{name}.tar.gz"
        with tarfile.open(path, "w:gz") as tar:
            info = tarfile.TarInfo("memory/manifest.json")
            info.size = len(data)
            tar.addfile(info, BytesIO(data))
        return str(path)

    def template(self, name: str, content: bytes) -> str:
        path = self.root / name
        path.write_bytes(content)
        return str(path)


GOOD_MANIFEST = {"part": "memory", "model": "llama2-7b", "smoke": True, "device_slug": "cpu",
                 "steps": [{"name": "check", "status": "ok", "seconds": 1.0}]}
CHAT_ROW = {"prompt": [{"role": "user", "content": "How do I bake bread?"}],
            "chosen": [{"role": "assistant", "content": "Mix flour, water and yeast, then bake it."}],
            "rejected": [{"role": "assistant", "content": "No."}]}


def sft(s: Scratch, *extra: str) -> list[str]:
    return ["-m", "trainer.sft", "--config", TINY_SFT, "--output_dir", str(s.path("sft-run")), *QUICK, *extra]


def sft_rows(s: Scratch, name: str, bad: str, policy: str) -> list[str]:
    data = rows_file(s.path(f"{name}.jsonl"), [hh_row(i) for i in range(120)] + [bad])
    return sft(s, "--dataset", data, "--on_bad_row", policy)


def chat_template(s: Scratch, name: str, content: bytes) -> list[str]:
    data = rows_file(s.path("chat.jsonl"), [CHAT_ROW] * 40)
    return sft(s, "--dataset", data, "--chat_template", s.template(name, content))


def collect(s: Scratch, name: str, manifest) -> list[str]:
    return ["-m", "benchmarks.gpu.collect", s.archive(name, manifest), "--results_dir", str(s.path("results")),
            "--readme", str(s.path("README.md"))]


def busy_output_dir(s: Scratch) -> list[str]:
    """A second run on the folder of a run that holds its lock: this case starts the first one itself."""
    out = s.path("busy")
    holder = subprocess.Popen([sys.executable, "-c", "import os, sys, time; from trainer.engine.run_lock import RunLock; "
                               "os.makedirs(sys.argv[1], exist_ok=True); "
                               "lock = RunLock.acquire(sys.argv[1]); print('held', flush=True); "
                               "time.sleep(120)", str(out)], cwd=PROJECT_ROOT, stdout=subprocess.PIPE, text=True)
    holder.stdout.readline()
    s.holders = getattr(s, "holders", []) + [holder]
    return ["-m", "trainer.sft", "--config", TINY_SFT, "--output_dir", str(out), *QUICK]


def full_disk(s: Scratch) -> list[str]:
    """A run whose output folder is a 256 KiB tmpfs: the first checkpoint does not fit."""
    mount = s.path("small-disk")
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)], check=True, capture_output=True)
    s.mounts = getattr(s, "mounts", []) + [mount]
    return ["-m", "trainer.sft", "--config", TINY_SFT, "--output_dir", str(mount / "run"), "--max_steps", "2",
            "--save_every", "1", "--eval_every", "0"]


def duplicate_yaml(s: Scratch, text: str) -> list[str]:
    path = s.path("duplicate.yaml")
    path.write_text(text)
    return ["-m", "trainer.sft", "--config", str(path), "--output_dir", str(s.path("dup-run"))]


def other_shape(record: dict) -> None:
    record["base_shape"] = {**record.get("base_shape", {}), "num_hidden_layers": 3}


# (issue item, what is wrong, how the command is built)
CASES: list[tuple[str, str, Callable[[Scratch], list[str]]]] = [
    ("1", "export: the adapter's base_model.json asks for trust_remote_code",
     lambda s: ["-m", "trainer.export", "--adapter",
                s.adapter_copy("trusting", lambda r: r.update(trust_remote_code=True)), "--out", str(s.path("x1"))]),
    ("1", "evaluate: the same adapter",
     lambda s: ["-m", "trainer.evaluate", "sft", "--adapter", str(s.path("trusting")), "--data",
                rows_file(s.path("eval.jsonl"), [hh_row(i) for i in range(8)])]),
    ("1", "collect: manifest part `../victim`", lambda s: collect(s, "climbs", {**GOOD_MANIFEST, "part": "../victim"})),
    ("1", "collect: manifest part is an absolute path",
     lambda s: collect(s, "absolute", {**GOOD_MANIFEST, "part": str(s.path("victim"))})),
    ("1", "collect: manifest without `model`",
     lambda s: collect(s, "no-model", {k: v for k, v in GOOD_MANIFEST.items() if k != "model"})),
    ("1", "collect: manifest part is a number", lambda s: collect(s, "number", {**GOOD_MANIFEST, "part": 7})),
    ("1", "collect: manifest is a list", lambda s: collect(s, "list", [GOOD_MANIFEST])),
    ("1", "collect: manifest is not JSON", lambda s: collect(s, "not-json", b"{part: memory")),
    ("2", "a second run on a busy --output_dir", busy_output_dir),
    ("2", "the disk fills while checkpointing", full_disk),
    ("2", "PPO: an SFT adapter recorded on another base shape",
     lambda s: ["-m", "trainer.ppo", "--config", TINY_PPO, "--output_dir", str(s.path("ppo-run")), "--sft_adapter",
                s.adapter_copy("other-shape", other_shape), *QUICK]),
    ("2", "evaluate: a tiny adapter on SmolLM2",
     lambda s: ["-m", "trainer.evaluate", "sft", "--adapter", str(s.adapter()), "--split", "eval",
                "--model_name_or_path", "smollm2-135m"]),
    ("2", "export: a LoHa adapter",
     lambda s: ["-m", "trainer.export", "--adapter", loha(s), "--out", str(s.path("x2"))]),
    ("2", "--learning_rate 1e30", lambda s: sft(s, "--learning_rate", "1e30")),
    ("2", "--learning_rate inf", lambda s: sft(s, "--learning_rate", "inf")),
    ("2", "--weight_decay inf", lambda s: sft(s, "--weight_decay", "inf")),
    ("2", "YAML: a key twice in one section",
     lambda s: duplicate_yaml(s, "train:\n  max_steps: 1\n  micro_batch_size: 4\n  max_steps: 2\n")),
    ("2", "YAML: a section twice", lambda s: duplicate_yaml(s, "train:\n  max_steps: 1\nmodel:\n  lora_r: 4\n"
                                                             "train:\n  micro_batch_size: 4\n")),
    ("2", "GRPO: --num_generations 1",
     lambda s: ["-m", "trainer.grpo", "--config", TINY_GRPO, "--output_dir", str(s.path("g")), "--num_generations", "1"]),
    ("2", "GRPO: --temperature 0",
     lambda s: ["-m", "trainer.grpo", "--config", TINY_GRPO, "--output_dir", str(s.path("g")), "--temperature", "0"]),
    ("2", "PPO: --temperature inf",
     lambda s: ["-m", "trainer.ppo", "--config", TINY_PPO, "--output_dir", str(s.path("p")), "--temperature", "inf"]),
    ("2", "SFT: --max_length past the model's positions", lambda s: sft(s, "--max_length", "2048")),
    ("2", "PPO: prompt + --max_new_tokens past the model's positions",
     lambda s: ["-m", "trainer.ppo", "--config", TINY_PPO, "--output_dir", str(s.path("p")), "--max_new_tokens", "1010"]),
    ("3", "a row with a lone surrogate, --on_bad_row skip",
     lambda s: sft_rows(s, "surrogate", r'{"chosen": "\n\nHuman: Hi \ud800\n\nAssistant: Hello", '
                                        r'"rejected": "\n\nHuman: Hi \ud800\n\nAssistant: No"}', "skip")),
    ("3", "the same row, --on_bad_row error",
     lambda s: sft_rows(s, "surrogate", r'{"chosen": "\n\nHuman: Hi \ud800\n\nAssistant: Hello", '
                                        r'"rejected": "\n\nHuman: Hi \ud800\n\nAssistant: No"}', "error")),
    ("3", "a row nested 200,000 deep, --on_bad_row skip",
     lambda s: sft_rows(s, "deep", "[" * 200_000 + "]" * 200_000, "skip")),
    ("3", "a row with a 5,000-digit integer, --on_bad_row skip",
     lambda s: sft_rows(s, "huge-int", '{"chosen": ' + "7" * 5000 + ', "rejected": "No."}', "skip")),
    ("3", "chat template that raises", lambda s: chat_template(s, "raises.jinja", b"{{ raise_exception('roles') }}")),
    ("3", "chat template that does not parse", lambda s: chat_template(s, "syntax.jinja", b"{% for m in messages %}")),
    ("3", "chat template printing an undefined name",
     lambda s: chat_template(s, "undefined.jinja", b"{% for m in messages %}{{ m.content }}{{ end_of_turn }}{% endfor %}")),
    ("3", "chat template that is not UTF-8", lambda s: chat_template(s, "latin1.jinja", b"{{ messages }} caf\xe9")),
    ("3", "chat template blocked by the sandbox", lambda s: chat_template(s, "sandbox.jinja", b"{{ messages.append(1) }}")),
    ("3", "200 rows sharing one prompt",
     lambda s: sft(s, "--dataset", rows_file(s.path("one-prompt.jsonl"), [
         {"chosen": hh_row(0)["chosen"] + f" Variant {i}.", "rejected": hh_row(0)["rejected"]} for i in range(200)]))),
    ("3", "--seed -1", lambda s: sft(s, "--seed", "-1")),
    ("3", "evaluate: --output_file is a folder",
     lambda s: ["-m", "trainer.evaluate", "sft", "--adapter", str(s.adapter()), "--split", "eval", "--output_file",
                str(s.root)]),
    ("3", "pipeline: --run_dir is a file",
     lambda s: ["-m", "trainer.pipeline", "--run_dir", rows_file(s.path("a-file.txt"), [])]),
]


def grpo(s: Scratch, *extra: str) -> list[str]:
    return ["-m", "trainer.grpo", "--config", TINY_GRPO, "--output_dir", str(s.path("g44")), *QUICK, *extra]


def rewarded(s: Scratch, name: str, code: str, *extra: str) -> list[str]:
    """A tiny GRPO run scored by the function `f` of a file holding `code`."""
    path = s.template(f"{name}.py", code.encode())
    return grpo(s, "--scripted_reward", "null", "--reward_fn", f"{path}:f", *extra)


def odd_lock(s: Scratch, kind: str) -> list[str]:
    """An output folder whose run.lock is a link to a file outside it, a folder, or a FIFO."""
    out = s.path(f"lock-{kind}")
    out.mkdir()
    lock = out / "run.lock"
    if kind == "symlink":
        (s.path("precious.txt")).write_text("keep me")
        lock.symlink_to(s.path("precious.txt"))
    elif kind == "folder":
        lock.mkdir()
    else:
        os.mkfifo(lock)
    return ["-m", "trainer.sft", "--config", TINY_SFT, "--output_dir", str(out), *QUICK]


def export_to_link(s: Scratch, dangling: bool) -> list[str]:
    link = s.path("dangling-out" if dangling else "linked-out")
    target = s.path("nowhere" if dangling else "empty-out")
    if not dangling:
        target.mkdir(exist_ok=True)
    link.symlink_to(target)
    return ["-m", "trainer.export", "--adapter", str(s.adapter()), "--out", str(link)]


def yaml_file(s: Scratch, name: str, text: str) -> list[str]:
    path = s.path(name)
    path.write_text(text)
    return ["-m", "trainer.sft", "--config", str(path), "--output_dir", str(s.path("yaml-run"))]


ALIAS_BOMB = "\n".join(['a0: &a0 ["x", "x", "x", "x", "x", "x", "x", "x", "x"]']
                       + [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 7)]
                       + ["model:", "  lora_r: *a6", ""])

# Issue 44: what a careless or unlucky user can still break (each also pinned by a test)
CASES += [
    ("44.1", "a reward of 1e308 (past float32)", lambda s: rewarded(s, "big", "def f(completions, **_):\n"
                                                                      "    return [1e308] * len(completions)\n")),
    ("44.1", "a reward of 10**400", lambda s: rewarded(s, "huge", "def f(completions, **_):\n"
                                                          "    return [10 ** 400] * len(completions)\n")),
    ("44.1", "--reward_weights 1e300", lambda s: rewarded(s, "weighted", "def f(completions, **_):\n"
                                                              "    return [1.0] * len(completions)\n",
                                                              "--reward_weights", "1e300")),
    ("44.2", "sys.exit(0) inside a reward function", lambda s: rewarded(s, "exits", "import sys\n"
                                                                         "def f(**_):\n    sys.exit(0)\n")),
    ("44.2", "sys.exit(0) when its file is imported", lambda s: rewarded(s, "exits_early", "import sys\nsys.exit(0)\n")),
    ("44.2", "a reward function that sleeps, --reward_timeout_s 2",
     lambda s: rewarded(s, "sleeps", "import time\ndef f(**_):\n    time.sleep(600)\n", "--reward_timeout_s", "2")),
    ("44.5", "GRPO --beta inf", lambda s: grpo(s, "--beta", "inf")),
    ("44.5", "GRPO --missing_eos_penalty nan", lambda s: grpo(s, "--missing_eos_penalty", "nan")),
    ("44.5", "GRPO --temperature 1e-30", lambda s: grpo(s, "--temperature", "1e-30")),
    ("44.5", "PPO --init_kl_coef inf",
     lambda s: ["-m", "trainer.ppo", "--config", TINY_PPO, "--output_dir", str(s.path("p44")), "--init_kl_coef", "inf"]),
    ("44.5", "--memory_budget_gib inf", lambda s: sft(s, "--memory_budget_gib", "inf")),
    ("44.5", "--model_seed 1e23", lambda s: sft(s, "--model_seed", "1e23")),
    ("44.5", "--preset_overrides num_hidden_layers=-1", lambda s: sft(s, "--preset_overrides", "num_hidden_layers=-1")),
    ("44.6", "run.lock is a link to a file outside the folder", lambda s: odd_lock(s, "symlink")),
    ("44.6", "run.lock is a folder", lambda s: odd_lock(s, "folder")),
    ("44.6", "run.lock is a FIFO", lambda s: odd_lock(s, "fifo")),
    ("44.8", "export --out is a link to an empty folder", lambda s: export_to_link(s, dangling=False)),
    ("44.8", "export --out is a dangling link", lambda s: export_to_link(s, dangling=True)),
    ("44.9", "YAML: a 400-byte alias bomb", lambda s: yaml_file(s, "bomb.yaml", ALIAS_BOMB)),
    ("44.9", "YAML: lists nested 20,000 deep",
     lambda s: yaml_file(s, "deep.yaml", "model:\n  lora_r: " + "[" * 20000 + "]" * 20000 + "\n")),
    ("44.9", "chat template repeating a string 10**8 times",
     lambda s: chat_template(s, "repeat.jinja", b"{{ 'x' * 100000000 }}")),
    ("44.10", "collect: manifest part demo, model smollm2-135m, device cpu",
     lambda s: collect(s, "demo", {**GOOD_MANIFEST, "part": "demo", "model": "smollm2-135m", "smoke": False,
                                   "device": "cpu"})),
    ("44.10", "collect: a manifest nested 100,000 deep",
     lambda s: collect(s, "deep", b'{"part": ' + b"[" * 100000 + b"]" * 100000 + b"}")),
    ("44.11", "exact_match --max_new_tokens 5000 on a 1024-position model",
     lambda s: ["-m", "trainer.evaluate", "exact_match", "--adapter", "none", "--model_name_or_path", "tiny-llama",
                "--reward_fn", "benchmarks/arithmetic/rewards.py:correct", "--max_new_tokens", "5000", "--data",
                rows_file(s.path("problems.jsonl"), [{"prompt": f"What is {i} + 1?", "answer": str(i + 1)}
                                                     for i in range(4)])]),
]


# Issue 65: what a hostile user could still do (each also pinned by a test)
CASES += [
    ("65.C", "a reward of -3e38 (float32 holds it, not its square)",
     lambda s: rewarded(s, "minus", "def f(completions, **_):\n    return [-3e38] * len(completions)\n")),
    ("65.D", "os._exit(0) inside a reward function",
     lambda s: rewarded(s, "os_exit", "import os\ndef f(**_):\n    os._exit(0)\n")),
    ("65.D", "os._exit(0) when its file is imported", lambda s: rewarded(s, "os_exit_early", "import os\nos._exit(0)\n")),
    ("65.D", "os._exit(3) inside a reward function",
     lambda s: rewarded(s, "os_exit_3", "import os\ndef f(**_):\n    os._exit(3)\n")),
    ("65.D", "a catastrophic regex, --reward_timeout_s 2",
     lambda s: rewarded(s, "regex", "import re\ndef f(completions, **_):\n    re.match(r'(a+)+$', 'a' * 64 + 'b')\n",
                        "--reward_timeout_s", "2")),
    ("65.D", "a reward function raising KeyboardInterrupt",
     lambda s: rewarded(s, "interrupt", "def f(**_):\n    raise KeyboardInterrupt\n")),
    ("65.D", "a reward function closing sys.stdout (harmless: the run goes on)",
     lambda s: rewarded(s, "stdout", "import sys\ndef f(completions, **_):\n    sys.stdout.close()\n"
                                     "    return [1.0] * len(completions)\n")),
    ("65.D", "a reward whose float() raises",
     lambda s: rewarded(s, "odd_float", "class Odd(float):\n    def __float__(self):\n        raise ValueError('no')\n"
                                        "def f(completions, **_):\n    return [Odd(1.0)] * len(completions)\n")),
]

def loha(s: Scratch) -> str:
    """A copy of the tiny adapter whose adapter_config.json says LOHA."""
    folder = s.path("loha")
    if not folder.exists():
        shutil.copytree(s.adapter(), folder)
        config = json.loads((folder / "adapter_config.json").read_text())
        (folder / "adapter_config.json").write_text(json.dumps({**config, "peft_type": "LOHA"}))
    return str(folder)


def run_case(s: Scratch, build: Callable[[Scratch], list[str]]) -> dict:
    try:
        argv = build(s)
    except (OSError, subprocess.CalledProcessError) as exc:
        return {"command": None, "exit_code": None, "line": f"not run here: {exc}"}
    proc = subprocess.run([sys.executable, *argv], cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    # A skipped row is logged (time, level, logger, message) where the data is read.
    skipped = [line for line in (proc.stdout + proc.stderr).splitlines() if " skipped " in line]
    line = errors[-1] if errors else (skipped[-1].split(" ", 3)[-1] if skipped else "")
    command = " ".join(["python", *(a.replace(str(s.root), "$SCRATCH") if len(a) < 200 else a[:40] + "..." for a in argv)])
    shared = str(PROJECT_ROOT.parent / "shared")  # the data beside the checkout, as the repo's docs name it
    line = line.replace(str(s.root), "$SCRATCH").replace(shared, "../shared")
    return {"command": command, "exit_code": proc.returncode, "line": line,
            "one_line": len(errors) <= 1 and "Traceback" not in proc.stderr}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out_dir", default="benchmarks/results/bad_inputs")
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        s = Scratch(Path(tmp))
        try:
            for item, what, build in CASES:
                rows.append({"item": item, "case": what, **run_case(s, build)})
                print(f"{rows[-1]['exit_code']}  {what}: {rows[-1]['line'][:150]}", flush=True)
        finally:
            for holder in getattr(s, "holders", []):
                holder.kill()
            for mount in getattr(s, "mounts", []):
                subprocess.run(["umount", str(mount)], capture_output=True)
    lines = ["| item | bad input | exit | one line printed (or the counted bad row) |", "|---|---|---|---|"]
    for r in rows:
        text = r["line"].replace("|", "\\|")
        lines.append(f"| {r['item']} | {r['case']} | {r['exit_code']} | `{text}` |")
    lines += ["", "Pinned by tests only (a fault in the middle of a command):", ""]
    lines += [f"- item {item}: {what}: `{test}`" for item, what, test in PINNED_BY_TESTS]
    out = Path(args.out_dir)
    meta = provenance()
    write_atomic(out / "result.json", json.dumps({"provenance": meta, "cases": rows}, indent=2))
    write_atomic(out / "README.md", f"# Bad inputs: exit code and one line each\n\n`{meta['command']}` at "
                 f"{meta['git_revision']}, {meta['date']}. Commands shown with the scratch folder as $SCRATCH.\n\n"
                 + "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
