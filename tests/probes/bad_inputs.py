"""Every bad input of the trust-and-correctness probe, run as a user would run it: the exit code and the one
line each command prints, written to docs/bad-inputs.md. Exits 1 if a command prints more than one error line
or a traceback.

    .venv/bin/python tests/probes/bad_inputs.py

Each case is a real command in its own process (115 of them: too slow for the suite, which pins about 40 of
these messages itself), on the tiny Llama or the embedded SmolLM2, against files in a scratch folder. A disk
filling mid-checkpoint runs on a small tmpfs where one can be mounted; a folder filled mid-export and a kill
during the final save are pinned by tests only.
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

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parents[1])]  # root, tests/

from conftest import plant_remote_code
from foundation.files import write_atomic
from foundation.provenance import PROJECT_ROOT, provenance
from profiling.report import table_lines

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
    ("65.G", "an --sft_adapter whose adapter_config.json names another base folder (peft saved its embeddings)",
     "tests/test_adapter_fit.py::test_a_saved_adapter_never_holds_the_base_embeddings"),
    ("65.F", "run_report --help made ./--help/report.md",
     "tests/test_run_report.py::test_the_command_prints_its_usage_for_help_and_writes_the_report_of_a_run"),
]


EXIT_CODES = """Exit code 2 is for a bad flag or config file and a reward function that fails; 1 is for bad data, model,
adapter or checkpoint files and for other failures during a run. A bad data row is counted and skipped, or with
`--on_bad_row error` it stops the run; the few cases that exit 0 are handled where they are (a row skipped, an odd
metric shown as missing, a reward function closing its own stdout)."""


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
     lambda s: ["-m", "trainer.export", "--adapter", adapter_files(s, "loha", {"peft_type": "LOHA"}), "--out",
                str(s.path("x2"))]),
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


def code_folder(s: Scratch, name: str, config_file: str) -> str:
    """SmolLM2's tokenizer files in a folder whose `config_file` names (auto_map) a module that writes `RAN`
    beside itself when imported (`conftest.plant_remote_code`)."""
    from trainer.model.loading import embedded_model_dir

    folder = s.path(name)
    if not folder.exists():
        shutil.copytree(embedded_model_dir(), folder, ignore=shutil.ignore_patterns("*.safetensors", "*config.json"))
        shutil.copy(embedded_model_dir() / "tokenizer_config.json", folder)
        plant_remote_code(folder, folder / "RAN", config_file)
    return str(folder)


def nan_adapter(s: Scratch) -> str:
    """A copy of the tiny adapter with one NaN in its last LoRA B matrix."""
    from safetensors.torch import load_file, save_file

    folder = s.path("nan-adapter")
    shutil.copytree(s.adapter(), folder)
    weights = folder / "adapter_model.safetensors"
    tensors = load_file(str(weights))
    tensors[sorted(k for k in tensors if "lora_B" in k)[-1]][0, 0] = float("nan")
    save_file(tensors, str(weights))
    return str(folder)


def run_folder(s: Scratch, name: str, stage_file: str, text: str) -> list[str]:
    """`python -m trainer.run_report` on a run folder whose sft/STAGE_FILE holds `text`."""
    folder = s.path(name)
    (folder / "sft").mkdir(parents=True, exist_ok=True)
    (folder / "sft" / stage_file).write_text(text)
    return ["-m", "trainer.run_report", str(folder)]


def without_wandb_login(s: Scratch) -> list[str]:
    """A tiny SFT run reporting to wandb where wandb has no key: no WANDB_* settings, no netrc."""
    home = s.path("no-wandb-home")
    home.mkdir(exist_ok=True)
    code = ("import os, sys; env = {k: v for k, v in os.environ.items() if not k.startswith('WANDB_')}; "
            "env.update(HOME=sys.argv[1], NETRC=os.path.join(sys.argv[1], '.netrc')); "
            "os.execve(sys.executable, [sys.executable, '-m', 'trainer.sft', *sys.argv[2:]], env)")
    return ["-c", code, str(home), "--config", TINY_SFT, "--output_dir", str(s.path("wandb-run")), *QUICK,
            "--report_to", "wandb"]


def planted_entry(s: Scratch, name: str, kind: str) -> list[str]:
    """A run folder where `name` is a link to something outside it, a FIFO, or a folder."""
    out = s.path(f"planted-{name}-{kind}")
    out.mkdir()
    outside = s.path(f"outside-{name}-{kind}")
    if kind == "link":
        outside.mkdir()
        target = outside if "." not in name else outside / "precious.txt"
        if target != outside:
            target.write_text("keep me")
        (out / name).symlink_to(target)
    elif kind == "fifo":
        os.mkfifo(out / name)
    else:
        (out / name).mkdir()
    return ["-m", "trainer.sft", "--config", TINY_SFT, "--output_dir", str(out), *QUICK]


# `ulimit -f 1` (1 KiB), set by the command itself: the SFT stage's entry point under that limit
FILE_LIMIT = ("import resource; resource.setrlimit(resource.RLIMIT_FSIZE, (1024, 1024)); "
              "from foundation.cli import run; from trainer.sft import main; run(main)")


def mounted(s: Scratch, name: str, options: str) -> Path:
    """A 64 KiB tmpfs at $SCRATCH/NAME (`options`: ro, or rw then filled to the last byte)."""
    mount = s.path(name)
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size=64k,{options}", "tmpfs", str(mount)], check=True,
                   capture_output=True)
    s.mounts = getattr(s, "mounts", []) + [mount]
    if options == "rw":
        fd = os.open(mount / "filler", os.O_WRONLY | os.O_CREAT)
        try:
            while os.write(fd, b"\0" * 4096):
                pass
        except OSError:  # ENOSPC: full to the last page
            pass
        finally:
            os.close(fd)
    return mount


def full_at_the_lock(s: Scratch) -> list[str]:
    return ["-m", "trainer.sft", "--config", TINY_SFT, "--output_dir", str(mounted(s, "full", "rw") / "run"), *QUICK]


def a_file(s: Scratch) -> str:
    path = s.path("a-file")
    path.write_text("mine")
    return str(path)


def a_folder(s: Scratch) -> str:
    path = s.path("a-folder")
    path.mkdir(exist_ok=True)
    return str(path)


ESTIMATE = ["-m", "profiling.estimate", "--model", "llama-2-7b", "--stage", "sft"]


def many_members(s: Scratch) -> list[str]:
    """A GPU-kit archive of 100,000 empty files (an uncompressed tar: quick to make)."""
    path = s.path("many.tar")
    with tarfile.open(path, "w") as tar:
        for i in range(100_000):
            tar.addfile(tarfile.TarInfo(f"memory/f{i}"))
    return ["-m", "benchmarks.gpu.collect", str(path), "--results_dir", str(s.path("results")),
            "--readme", str(s.path("README.md"))]


def not_an_archive(s: Scratch) -> list[str]:
    path = s.path("notes.tar.gz")
    path.write_text("not an archive\n")
    return ["-m", "benchmarks.gpu.collect", str(path), "--results_dir", str(s.path("results")),
            "--readme", str(s.path("README.md"))]


def checkpointed(s: Scratch, name: str, **state) -> str:
    """A copy of a tiny SFT run with a checkpoint at step 2 (trained once), its state.json fields set to `state`
    and its manifest rewritten to match (an edit, not damage)."""
    from trainer.engine.checkpoint import write_manifest

    made = s.path("checkpointed")
    if not made.exists():
        subprocess.run([sys.executable, "-m", "trainer.sft", "--config", TINY_SFT, "--output_dir", str(made),
                        "--max_steps", "2", "--save_every", "2", "--eval_every", "0"], cwd=PROJECT_ROOT, check=True,
                       capture_output=True)
    out = s.path(name)
    shutil.copytree(made, out)
    checkpoint = out / "checkpoint-0000002"
    saved = json.loads((checkpoint / "state.json").read_text())
    (checkpoint / "state.json").write_text(json.dumps({**saved, **state}))
    write_manifest(checkpoint)
    return str(out)


def resume(s: Scratch, name: str, *extra: str, **state) -> list[str]:
    run = checkpointed(s, name, **state)
    return ["-m", "trainer.sft", "--config", TINY_SFT, "--output_dir", run, "--save_every", "2", "--eval_every", "0",
            *extra]


def adapter_files(s: Scratch, name: str, config: dict, pickled: bool = False) -> str:
    """A copy of the tiny adapter with `config` over its adapter_config.json; `pickled`: its weights as
    adapter_model.bin (a pickle, torch.save's) instead of adapter_model.safetensors."""
    import torch
    from safetensors.torch import load_file

    folder = s.path(name)
    if not folder.exists():
        shutil.copytree(s.adapter(), folder)
        saved = json.loads((folder / "adapter_config.json").read_text())
        (folder / "adapter_config.json").write_text(json.dumps({**saved, **config}))
        if pickled:
            torch.save(load_file(str(folder / "adapter_model.safetensors")), folder / "adapter_model.bin")
            (folder / "adapter_model.safetensors").unlink()
    return str(folder)


def model_config(s: Scratch, name: str, config) -> str:
    """A model folder holding only `config` as its config.json."""
    folder = s.path(name)
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


# Issue 65: what a hostile user could still do (each also pinned by a test), listed by item
CASES += sorted([
    ("65.A", "export: the adapter's base is a model folder whose config.json names its own code (auto_map)",
     lambda s: ["-m", "trainer.export", "--adapter", s.adapter_copy(
         "on-code-model", lambda r: r.update(model_name_or_path=code_folder(s, "code-model", "config.json"))),
         "--out", str(s.path("x65a"))]),
    ("65.A", "evaluate: the same adapter",
     lambda s: ["-m", "trainer.evaluate", "sft", "--adapter", str(s.path("on-code-model")), "--data",
                rows_file(s.path("eval.jsonl"), [hh_row(i) for i in range(8)])]),
    ("65.A", "sft: --model_name_or_path a folder whose config.json names its own code",
     lambda s: ["-m", "trainer.sft", "--config", TINY_SFT, "--output_dir", str(s.path("code-run")), *QUICK,
                "--model_name_or_path", code_folder(s, "code-model", "config.json")]),
    ("65.A", "sft: --tokenizer_name_or_path a folder whose tokenizer_config.json names its own code",
     lambda s: ["-m", "trainer.sft", "--config", TINY_SFT, "--output_dir", str(s.path("code-run")), *QUICK,
                "--tokenizer_name_or_path", code_folder(s, "code-tok", "tokenizer_config.json")]),
    ("65.A", "export: the adapter's base_model.json names such a tokenizer",
     lambda s: ["-m", "trainer.export", "--adapter", s.adapter_copy(
         "on-code-tok", lambda r: r.update(tokenizer_name_or_path=code_folder(s, "code-tok", "tokenizer_config.json"))),
         "--out", str(s.path("x65a"))]),
    ("65.C", "export: an adapter holding a NaN",
     lambda s: ["-m", "trainer.export", "--adapter", nan_adapter(s), "--out", str(s.path("x65c"))]),
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
    ("65.F", "run_report: strings in metrics.jsonl",
     lambda s: run_folder(s, "report-strings", "metrics.jsonl", '{"step": 1, "train/loss": "high", "perf/step_s": 2.0}\n'
                          '{"step": 2, "train/loss": 1.5, "perf/step_s": "slow"}\n')),
    ("65.F", "run_report: 10**400 in metrics.jsonl",
     lambda s: run_folder(s, "report-huge", "metrics.jsonl", '{"step": 1, "train/loss": 1' + "0" * 400 + "}\n")),
    ("65.F", "run_report: results.json is a JSON list", lambda s: run_folder(s, "report-list", "results.json", "[1, 2]")),
    ("65.F", "run_report: results.json is not JSON",
     lambda s: run_folder(s, "report-not-json", "results.json", '{"stage": ')),
    ("65.F", "run_report: RUN_DIR is a file", lambda s: ["-m", "trainer.run_report", rows_file(s.path("a-file.txt"), [])]),
    ("65.F", "run_report: a mistyped RUN_DIR", lambda s: ["-m", "trainer.run_report", str(s.path("runs") / "dmeo")]),
    ("65.F", "run_report: no RUN_DIR", lambda s: ["-m", "trainer.run_report"]),
    ("65.I", "--report_to wandb without a key (online mode, no login)", without_wandb_login),
    ("65.I", "--eval_size 0 (nothing held out: no evaluation, no eval figures; the run goes on)",
     lambda s: sft(s, "--eval_size", "0")),
    ("65.I", "--split_seed -1", lambda s: sft(s, "--split_seed", "-1")),
    ("65.I", "--mixed_precision fp16 on the CPU", lambda s: sft(s, "--mixed_precision", "fp16")),
    ("65.I", 'YAML max_steps: "ten"', lambda s: yaml_file(s, "ten.yaml", 'train:\n  max_steps: "ten"\n')),
    ("65.I", "a 0-byte config file", lambda s: yaml_file(s, "empty.yaml", "")),
    ("65.I", "a config file of comments only", lambda s: yaml_file(s, "comments.yaml", "# train:\n#   max_steps: 3\n")),
    ("65.I", "estimate --max_length 999999999999",
     lambda s: ["-m", "profiling.estimate", "--model", "llama-2-7b", "--stage", "sft", "--max_length", "999999999999"]),
    ("65.I", "pipeline --overrides output_dir=... (outside --run_dir)",
     lambda s: ["-m", "trainer.pipeline", "--run_dir", str(s.path("pipe")), "--overrides",
                f"output_dir={s.path('outside')},max_steps=1"]),
    ("65.J", "accelerate launch -q of a run with a bad flag (the launcher's traceback left out)",
     lambda s: ["-m", "accelerate.commands.launch", "-q", "--cpu", "--num_processes", "1", "trainer/sft.py",
                "--config", TINY_SFT, "--output_dir", str(s.path("launched")), "--max_steps", "0"]),
    ("65.planner", "PPO --auto_fit: --micro_batch_size 4 without checkpointing fits only the whole 0.04 GiB "
     "budget, rollout rows left auto (planned to 4; starts)",
     lambda s: ["-m", "trainer.ppo", "--config", TINY_PPO, "--output_dir", str(s.path("p65-fits")), "--auto_fit", "true",
                "--memory_budget_gib", "0.04", "--micro_batch_size", "4", "--no_gradient_checkpointing",
                "--rollout_micro_batch_size", "auto", *QUICK]),
    ("65.planner", "the same at 0.035 GiB: nothing fits; the error names the given micro-batch",
     lambda s: ["-m", "trainer.ppo", "--config", TINY_PPO, "--output_dir", str(s.path("p65-over")), "--auto_fit", "true",
                "--memory_budget_gib", "0.035", "--micro_batch_size", "4", "--no_gradient_checkpointing",
                "--rollout_micro_batch_size", "auto", *QUICK]),
    ("65.B", "metrics.jsonl is a link to a file outside the run folder", lambda s: planted_entry(s, "metrics.jsonl", "link")),
    ("65.B", "tensorboard/ is a link to a folder outside", lambda s: planted_entry(s, "tensorboard", "link")),
    ("65.B", "metrics.jsonl is a FIFO", lambda s: planted_entry(s, "metrics.jsonl", "fifo")),
    ("65.E", "config.json in the run folder is a folder", lambda s: planted_entry(s, "config.json", "folder")),
    ("65.E", "ulimit -f 1 (1 KiB) at start-up", lambda s: ["-c", FILE_LIMIT, *sft(s)[2:]]),
    ("65.E", "a full disk while taking the run lock (a 64 KiB tmpfs, filled)", full_at_the_lock),
    ("65.E", "estimate --out_dir names a file", lambda s: [*ESTIMATE, "--out_dir", a_file(s)]),
    ("65.E", "estimate --json names a folder", lambda s: [*ESTIMATE, "--json", a_folder(s)]),
    ("65.E", "estimate --out_dir on a read-only filesystem",
     lambda s: [*ESTIMATE, "--out_dir", str(mounted(s, "ro-out", "ro") / "reports")]),
    ("65.E", "estimate --json on a read-only filesystem",
     lambda s: [*ESTIMATE, "--json", str(mounted(s, "ro-json", "ro") / "estimate.json")]),
    ("65.E", "collect --results_dir names a file",
     lambda s: [*collect(s, "good", GOOD_MANIFEST)[:-4], "--results_dir", a_file(s), "--readme", str(s.path("README.md"))]),
    ("65.I", "collect: an archive of 100,000 members", many_members),
    ("65.I", "collect: a file that is not an archive", not_an_archive),
    ("65.G", "resume onto another base under --resume_config_check false",
     lambda s: resume(s, "other-base", "--max_steps", "4", "--preset_overrides", "num_hidden_layers=3",
                      "--resume_config_check", "false")),
    ("65.G", "adapter_config.json says r=8, its weights are r=4",
     lambda s: ["-m", "trainer.export", "--adapter", adapter_files(s, "rank-8", {"r": 8}), "--out", str(s.path("x65"))]),
    ("65.G", "--init_adapter: an adapter_model.bin (a pickle)",
     lambda s: sft(s, "--init_adapter", adapter_files(s, "pickled", {}, pickled=True))),
    ("65.G", "export: the same adapter",
     lambda s: ["-m", "trainer.export", "--adapter", adapter_files(s, "pickled", {}, pickled=True), "--out",
                str(s.path("x65"))]),
    ("65.G", "evaluate: the same adapter",
     lambda s: ["-m", "trainer.evaluate", "sft", "--adapter", adapter_files(s, "pickled", {}, pickled=True), "--data",
                rows_file(s.path("eval65.jsonl"), [hh_row(i) for i in range(8)])]),
    ("65.G", "estimate: a model config.json without hidden_size",
     lambda s: ["-m", "profiling.estimate", "--model_name_or_path",
                model_config(s, "odd-model", {"model_type": "llama", "num_hidden_layers": 2})]),
    ("65.H", "state.json: step -5",
     lambda s: resume(s, "step-negative", "--max_steps", "3", "--resume",
                      str(s.path("step-negative") / "checkpoint-0000002"), step=-5)),
    ("65.H", "state.json: step 10**30",
     lambda s: resume(s, "step-huge", "--max_steps", "3", "--resume", str(s.path("step-huge") / "checkpoint-0000002"),
                      step=10**30)),
    ("65.H", "a checkpoint of a longer run (step 2, --max_steps 1)", lambda s: resume(s, "longer", "--max_steps", "1")),
], key=lambda case: case[0])

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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="docs/bad-inputs.md", help="The Markdown table to write.")
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
    lines = table_lines(["item", "bad input", "exit", "one line printed (or the counted bad row)"], "llll", [
        [r["item"], r["case"], r["exit_code"], "`" + r["line"].replace("|", "\\|") + "`"] for r in rows])
    lines += ["", "Pinned by tests only (a fault in the middle of a command):", ""]
    lines += [f"- item {item}: {what}: `{test}`" for item, what, test in PINNED_BY_TESTS]
    meta = provenance()
    not_one_line = [r["case"] for r in rows if r.get("one_line") is False]
    summary = f"{len(rows) - len(not_one_line)} of {len(rows)} print one line" + (
        f"; more than one line or a traceback: {', '.join(not_one_line)}" if not_one_line else "")
    out = Path(args.out).resolve()
    probe = os.path.relpath(Path(__file__).resolve(), out.parent)
    write_atomic(out, f"# Bad inputs: exit code and one line each\n\n[The probe]({probe}): `{meta['command']}` at "
                 f"{meta['git_revision']}, {meta['date']}, on {meta['device_name']}: {summary}. Commands shown "
                 "with the scratch folder as $SCRATCH.\n\n" + EXIT_CODES + "\n\n" + "\n".join(lines) + "\n")
    print("\n".join(lines) + "\n" + summary)
    return 1 if not_one_line else 0


if __name__ == "__main__":
    sys.exit(main())
