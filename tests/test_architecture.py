"""The shape of the code: layers point one way and no module imports itself round a cycle.

The graph is read from the source (every `import` and `from ... import`, at module level or inside a
function), so an import hidden in a function body counts like any other.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Optional

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("foundation", "trainer", "profiling", "benchmarks")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}


def imports_of(path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules `path` imports (an `from a.b import c` counts as a.b.c when that is a module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = project_modules()
    graph = {name: imports_of(path, modules) - {name} for name, path in modules.items()}
    for name in graph:  # importing a.b.c runs the package a.b's __init__, which imports nothing here
        graph[name] = {m for m in graph[name] if not (ROOT / m.replace(".", "/") / "__init__.py").is_file()}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle as a list of modules (first == last), or [] when there is none."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return []


def test_no_module_imports_itself_round_a_cycle():
    cycle = find_cycle(import_graph())
    assert not cycle, " -> ".join(cycle)


# Layers, lowest first: a module imports only from its own layer or the ones below it.
LAYERS = (
    ("foundation",),
    ("profiling",),
    ("trainer.config", "trainer.losses"),
    ("trainer.data", "trainer.model"),
    ("trainer.rl", "trainer.engine"),
    ("trainer",),  # the stage scripts and the user tools
    ("benchmarks",),
)


def layer_of(module: str) -> int:
    """The index in LAYERS of the longest prefix naming `module` (or a package above it)."""
    best, rank = -1, -1
    for i, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, rank = len(prefix), i
    return rank


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{m} -> {d}" for m, deps in graph.items() for d in deps if layer_of(d) > layer_of(m))


def test_every_import_points_down_the_layers():
    graph = import_graph()
    assert all(layer_of(m) >= 0 for m in graph), [m for m in graph if layer_of(m) < 0]
    assert not upward_imports(graph)


def test_the_foundation_imports_nothing_of_the_project():
    offenders = {m: sorted(deps) for m, deps in import_graph().items() if m.startswith("foundation")}
    assert not {m: d for m, d in offenders.items() if any(not i.startswith("foundation") for i in d)}


def test_profiling_is_a_leaf_that_imports_nothing_from_trainer_or_benchmarks():
    offenders = {m: sorted(i for i in deps if i.startswith(("trainer", "benchmarks")))
                 for m, deps in import_graph().items() if m.startswith("profiling")}
    assert not {m: d for m, d in offenders.items() if d}


def test_trainer_does_not_import_the_benchmarks():
    offenders = {m: sorted(i for i in deps if i.startswith("benchmarks"))
                 for m, deps in import_graph().items() if m.startswith("trainer")}
    assert not {m: d for m, d in offenders.items() if d}


STAGE_SCRIPTS = ("trainer.sft", "trainer.reward", "trainer.dpo", "trainer.ppo", "trainer.grpo")


def test_no_stage_script_imports_another_or_the_pipeline():
    """What two stages share lives below them (trainer.rl, trainer.engine); only the pipeline runs stages in order."""
    graph = import_graph()
    offenders = {m: sorted(graph[m] & {*STAGE_SCRIPTS, "trainer.pipeline"}) for m in STAGE_SCRIPTS}
    assert not {m: d for m, d in offenders.items() if d}


def test_the_checks_see_a_cycle_and_a_backwards_import_when_there_is_one(tmp_path):
    """The walkers above are not vacuous: a planted cycle is found, and so is a function-level import."""
    graph = import_graph()
    assert graph["trainer.ppo"] >= {"trainer.rl.online", "trainer.rl.algorithms.ppo"}  # the graph is real
    planted = {**graph, "trainer.rl.online": graph["trainer.rl.online"] | {"trainer.ppo"}}
    assert find_cycle(planted)[0] == find_cycle(planted)[-1]
    upward = {**graph, "trainer.model.loading": graph["trainer.model.loading"] | {"trainer.engine.launch"}}
    assert upward_imports(upward) == ["trainer.model.loading -> trainer.engine.launch"]
    hidden = tmp_path / "hidden.py"
    hidden.write_text("def f():\n    from trainer.config import TrainArguments\n    return TrainArguments\n")
    assert imports_of(hidden, project_modules()) == {"trainer.config"}


def test_one_table_says_which_adapters_each_stage_has():
    """foundation.stages is the table; the stages, the estimator and the benchmark all read it."""
    from foundation.stages import ADAPTERS, HEADED, TRAINED
    from trainer.model.shared_base import stage_specs

    for stage, roles in ADAPTERS.items():
        specs = stage_specs(stage, {})
        assert [s.name for s in specs] == list(roles)
        assert {s.name for s in specs if s.trainable} == set(TRAINED[stage])
        assert {s.name for s in specs if s.head} == set(roles) & set(HEADED)
    graph = import_graph()
    for reader in ("trainer.model.shared_base", "profiling.predict"):
        assert "foundation.stages" in graph[reader], reader


def classes_in(folder: str) -> dict[str, list[ast.ClassDef]]:
    """Every class defined under `folder`, by module."""
    return {module_name(p): [n for n in ast.walk(ast.parse(p.read_text())) if isinstance(n, ast.ClassDef)]
            for p in (ROOT / folder).rglob("*.py")}


def test_one_rollout_and_one_state_serve_every_online_rl_method():
    """PPO, GRPO and RLOO share the rollout, the state carried between steps and the step itself."""
    found = classes_in("trainer")
    rollouts = sorted(f"{m}.{c.name}" for m, classes in found.items() for c in classes if c.name.endswith("Rollout"))
    # what a run carries between steps: a class that loads a checkpoint's state (the KL controllers are
    # parts of it)
    states = sorted(f"{m}.{c.name}" for m, classes in found.items() if m.startswith("trainer.rl") for c in classes
                    if any(isinstance(f, ast.FunctionDef) and f.name == "load_state_dict" for f in c.body))
    assert rollouts == ["trainer.rl.rollout.Rollout"]
    assert [s for s in states if not s.startswith("trainer.rl.kl_control.")] == ["trainer.rl.online.RLState"]


# What a method's file may import: the losses, the rollout's shape, how a response is scored, the base it
# subclasses, its KL controller and the ranks' mean - the maths and nothing of the plumbing.
MATHS_IMPORTS = {"foundation.stages", "trainer.losses", "trainer.rl.rollout", "trainer.rl.scoring",
                 "trainer.rl.online", "trainer.rl.kl_control", "trainer.engine.metrics"}


def test_the_method_files_hold_their_maths_and_the_shared_step_the_plumbing():
    graph = import_graph()
    methods = [m for m in graph if m.startswith("trainer.rl.algorithms.")]
    assert sorted(methods) == ["trainer.rl.algorithms.grpo", "trainer.rl.algorithms.ppo", "trainer.rl.algorithms.rloo"]
    for module in methods:
        assert graph[module] - MATHS_IMPORTS - set(methods) == set(), module
    assert {"trainer.rl.rollout", "trainer.rl.update", "trainer.engine.phases"} <= graph["trainer.rl.online"]
    for stage in ("trainer.ppo", "trainer.grpo"):  # the entry points train through the one path
        assert "trainer.rl.online" in graph[stage] and "trainer.rl.update" not in graph[stage]


def test_docs_code_map_names_real_files_at_most_four_a_flag_and_its_declaration_first():
    """docs/code.md's flag table: every file it names exists, a row crosses at most four files, and the
    flag is declared (a field of that name) in the row's first file."""
    import re

    rows = [line for line in (ROOT / "docs" / "code.md").read_text().splitlines() if line.startswith("| `--")]
    assert len(rows) >= 8
    for row in rows:
        files = list(dict.fromkeys(re.findall(r"`((?:trainer|profiling|foundation)/[\w/]+\.py)`", row)))
        assert files and len(files) <= 4 and all((ROOT / f).is_file() for f in files), row
        flag = re.match(r"\| `--(\w+)", row).group(1)
        assert re.search(rf"^    {flag}: ", (ROOT / files[0]).read_text(), re.MULTILINE), (flag, files[0])


# The ten flags of docs/code.md's table, and what names a settings object or a run's plan in trainer/.
FLAGS = ("cliprange", "num_generations", "init_kl_coef", "adaptive_kl", "advantage", "micro_batch_size",
         "gradient_checkpointing", "offload_activations", "generation_weights", "decode")
SETTINGS_OBJECTS = {"args", "model_args", "data_args", "train_args", "targs", "stage_args", "plan", "settings"}


def flag_readers(flag: str) -> set[str]:
    """The modules of trainer/ that read `flag` from a settings object or the plan: `X.flag` or
    `getattr(X, "flag", ...)` with X (or its last attribute: `ctx.plan`) one of SETTINGS_OBJECTS."""
    def named(node) -> Optional[str]:
        return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None

    readers = set()
    for path in sorted((ROOT / "trainer").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            read = isinstance(node, ast.Attribute) and node.attr == flag and named(node.value) in SETTINGS_OBJECTS
            read = read or (isinstance(node, ast.Call) and named(node.func) == "getattr" and len(node.args) >= 2
                            and isinstance(node.args[1], ast.Constant) and node.args[1].value == flag
                            and named(node.args[0]) in SETTINGS_OBJECTS)
            if read:
                readers.add(str(path.relative_to(ROOT)))
    return readers


@pytest.mark.parametrize("flag", FLAGS)
def test_a_flag_is_read_in_at_most_four_modules_and_docs_code_md_names_each(flag):
    """From a flag to its effect: the modules that read it from the settings or the run's plan, found in the code,
    are at most four, and docs/code.md's rows for the flag name every one."""
    import re

    readers = flag_readers(flag)
    rows = [line for line in (ROOT / "docs" / "code.md").read_text().splitlines()
            if re.match(rf"\| `--{flag}\b|\| .*`--{flag}`", line)]
    named = {f for row in rows for f in re.findall(r"`((?:trainer|profiling|foundation)/[\w/]+\.py)`", row)}
    assert readers and len(readers) <= 4, (flag, sorted(readers))
    assert readers <= named, (flag, sorted(readers - named))


# What changes a container in place: a module-level name used so is state every caller shares.
MUTATING = {"append", "add", "update", "setdefault", "pop", "popitem", "clear", "discard", "remove", "extend",
            "insert"}


def module_state(path: Path) -> list[str]:
    """The module-level names of `path` that its code changes in place (an item or attribute set or deleted, a
    mutating method called) or rebinds (`global`): state kept between calls, outside any object."""
    tree = ast.parse(path.read_text())
    names = {t.id for node in tree.body if isinstance(node, (ast.Assign, ast.AnnAssign))
             for t in (node.targets if isinstance(node, ast.Assign) else [node.target]) if isinstance(t, ast.Name)}
    changed = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            changed.update(node.names)
        targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else (
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
        for target in targets:
            if isinstance(target, (ast.Subscript, ast.Attribute)) and isinstance(target.value, ast.Name):
                changed.add(target.value.id)
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATING
                and isinstance(node.func.value, ast.Name)):
            changed.add(node.func.value.id)
    return sorted(names & changed)


def test_the_model_and_rl_code_keep_no_state_at_module_level():
    """What decoding and the RL step keep between calls lives in objects a run owns (the Generator, the
    state), never in a module: two models, two runs or two tests in one process cannot see each other's."""
    found = {module_name(p): module_state(p) for folder in ("trainer/model", "trainer/rl")
             for p in (ROOT / folder).rglob("*.py")}
    assert {m: names for m, names in found.items() if names} == {}


def test_the_state_check_sees_a_cache_a_flag_and_a_rebinding(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text("import weakref\n_CACHE = weakref.WeakKeyDictionary()\n_FLAG = [False]\n_SEEN = set()\n"
                       "COUNT = 0\nTABLE = {'a': 1}\n"
                       "def f(m):\n    _CACHE[m] = 1\n    _FLAG[0] = True\n    _SEEN.add(m)\n    global COUNT\n"
                       "    COUNT += 1\n    return TABLE['a']\n")
    assert module_state(planted) == ["COUNT", "_CACHE", "_FLAG", "_SEEN"]


def test_nothing_in_the_trainer_writes_an_attribute_onto_a_model_for_the_memory_recorder():
    """The recorder learns what decoding holds from the decoder itself (`MemoryRecorder.track(holder=...)`):
    no attribute set on a module for it to find."""
    import re

    for path in (ROOT / "trainer").rglob("*.py"):
        assert not re.search(r"HELD_[A-Z_]+", path.read_text()), path
    assert not re.search(r"^HELD_", (ROOT / "profiling" / "tensors.py").read_text(), re.MULTILINE)


def defined_and_imported() -> dict[str, tuple[set[str], set[str]]]:
    """Each project module: (the names it defines at module level, the names it imports at module level)."""
    out = {}
    for module, path in project_modules().items():
        defined, imported = set(), set()
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                imported.update((a.asname or a.name).split(".")[0] for a in node.names)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defined.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                defined.update(t.id for t in targets if isinstance(t, ast.Name))
        out[module] = (defined, imported)
    return out


def project_from_imports(path: Path) -> list[tuple[int, str, str]]:
    """(line, module, name) of every `from MODULE import NAME` of a project module in `path`, at any depth."""
    return [(node.lineno, node.module, alias.name) for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
            and node.module.split(".")[0] in PACKAGES for alias in node.names]


def test_every_name_is_imported_from_the_module_that_defines_it():
    """No re-export shims: a name comes from its owner, never from a module that only imported it itself."""
    modules, owners = project_modules(), defined_and_imported()
    files = [*modules.values(), *(ROOT / "tests").rglob("*.py")]
    wrong = [f"{path.relative_to(ROOT)}:{line}: {name} from {module}" for path in files
             for line, module, name in project_from_imports(path)
             if module in owners and name in owners[module][1] and name not in owners[module][0]
             and f"{module}.{name}" not in modules]
    assert wrong == []


def test_no_module_passes_on_what_it_imports():
    """A project name a module imports is one it uses (else it is there to be imported from it), and no module
    lists an `__all__`."""
    unused = []
    for module, path in project_modules().items():
        tree = ast.parse(path.read_text())
        used = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
        assert "__all__" not in used, module
        unused += [f"{module}: {alias.asname or alias.name}" for node in tree.body
                   if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in PACKAGES
                   for alias in node.names if (alias.asname or alias.name) not in used]
    assert unused == []


def test_no_test_imports_a_private_name():
    """Tests hold the code to its behaviour through public names."""
    private = [f"{path.name}:{line}: {module}.{name}" for path in (ROOT / "tests").rglob("*.py")
               for line, module, name in project_from_imports(path) if name.startswith("_")]
    assert private == []


def test_no_function_is_there_only_for_the_tests():
    """Every module-level function and class of the project is used by the project (a decorated one is, by its
    decorator): one that only tests call holds behaviour no run has."""
    import re
    from collections import Counter

    texts = {path: path.read_text() for path in project_modules().values()}
    words = Counter(word for text in texts.values() for word in re.findall(r"\w+", text))
    unused = [f"{path.relative_to(ROOT)}: {node.name}" for path, text in texts.items() for node in ast.parse(text).body
              if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.decorator_list
              and words[node.name] < 2]  # its definition only
    assert unused == []
