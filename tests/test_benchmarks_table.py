"""The results tables (README.md: the newest result of each benchmark; docs/results.md: every folder) are
generated from the committed result files, and every relative link in the user documentation points at a file
of the repository."""

import json
import re
import shutil
from pathlib import Path

import pytest

from benchmarks import results_table as rt

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")  # [text](target) and ![image](target)


def test_the_table_has_one_row_per_result_folder_each_linking_its_report():
    folders = sorted(p.name for p in rt.RESULTS.iterdir() if p.is_dir())
    rows = rt.rows()
    assert sorted(r.report.split("/")[0] for r in rows) == folders
    for r in rows:
        assert (rt.RESULTS / r.report).is_file(), r.report  # every committed folder has its report
        assert r.headline and r.date[:2] == "20" and r.device != "?", r


def test_the_ppo_row_reads_its_figures_from_the_result_file():
    row = next(r for r in rt.rows() if r.report.startswith("ppo_vs_trl-"))
    rep = json.loads((rt.RESULTS / row.report.replace(".md", ".json")).read_text())
    ours, trl = (rep["sides"][s]["summary"]["step_s"] for s in ("ours", "trl"))
    assert f"step {ours:.2f} s, TRL {trl:.2f} s: {trl / ours:.2f}x" in row.headline


def test_a_gpu_kit_row_names_the_figures_of_its_files_and_the_revision_of_a_kept_one(tmp_path):
    """A GPU part's row: its steps, PPO against TRL (a file an earlier run kept names its own revision), the fastest
    decode at 16 rows, and the range of measured over estimated device memory; a smoke run's row only its steps."""
    import json

    folder = tmp_path / "speed-llama-2-7b-nvidia-h200"
    for sub in ("ppo_vs_trl", "decode", "grpo"):
        (folder / sub).mkdir(parents=True)
    steps = {"grpo": {"status": "ok", "seconds": 91.0}, "ppo_vs_trl": {"status": "cut", "seconds": 3.0}}
    (folder / "manifest.json").write_text("{}")  # what marks a GPU kit part's folder
    (folder / "provenance.json").write_text(json.dumps(
        {"part": "speed", "model": "llama-2-7b", "smoke": False, "device_name": "NVIDIA H200", "date": "2026-11-27",
         "command": "benchmarks/gpu/run.sh speed", "git_revision": "b" * 40, "seconds": 507.0, "steps": steps}))
    side = lambda status, step_s: {"status": status, "summary": {"step_s": step_s}}  # noqa: E731
    (folder / "ppo_vs_trl" / "ppo_vs_trl.json").write_text(json.dumps(
        {"git_revision": "a" * 40, "sides": {"ours_eager": side("ok", 7.19), "ours": side("ok", 5.93),
                                              "trl": side("ok", 21.01)}}))
    (folder / "decode" / "decode.json").write_text(json.dumps({"git_revision": "b" * 40, "rows": [
        {"path": "compiled", "weights": "fused", "batch": 16, "ms_per_step": 26.33},
        {"path": "compiled", "weights": "dequantized", "batch": 16, "ms_per_step": 7.648},
        {"path": "compiled", "weights": "dequantized", "batch": 1, "ms_per_step": 6.1}]}))
    (folder / "grpo" / "vs_estimate.json").write_text(json.dumps(
        {"phases": [{"total_ratio": 0.98}, {"total_ratio": 0.95}, {"total_ratio": None}]}))
    assert rt.row_for(folder).headline == (
        "1 of 2 steps ok in 507 s; PPO step 5.93 s, TRL's 21.01 s (at `aaaaaaa`); decoding 16 rows 7.65 ms a step "
        "(compiled, dequantized); measured / estimated device memory per phase 0.95-0.98")
    prov = json.loads((folder / "provenance.json").read_text())
    (folder / "provenance.json").write_text(json.dumps({**prov, "smoke": True}))
    assert rt.row_for(folder).headline == "1 of 2 steps ok in 507 s"


@pytest.mark.parametrize("page", list(rt.PAGES), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_the_page_table_equals_the_generator_output(page):
    now, regenerated = rt.rewritten(page, rt.RESULTS, rt.PAGES[page])
    assert now == regenerated, f"stale results table in {page}: run python -m benchmarks.results_table"


def table_rows(text: str) -> list[str]:
    section = text.split(rt.START, 1)[1].split(rt.END, 1)[0]
    return [line for line in section.splitlines() if line.startswith("| ")][1:]  # the header row left out


def test_the_readme_shows_at_most_12_rows_one_per_benchmark_gpu_first_and_docs_every_folder():
    readme = table_rows((ROOT / "README.md").read_text())
    assert 0 < len(readme) <= 12
    folders = [p for p in rt.RESULTS.iterdir() if p.is_dir()]
    assert len(table_rows((ROOT / "docs" / "results.md").read_text())) == len(folders)
    benchmarks = [line.split(" | ")[0] for line in readme]
    assert len(set(benchmarks)) == len(benchmarks)
    on_gpu = [" | NVIDIA " in line for line in readme]
    assert on_gpu[0] and on_gpu == sorted(on_gpu, reverse=True)  # the GPU rows first, then the CPU's


def test_the_summary_keeps_the_newest_user_row_of_each_benchmark():
    def row(benchmark, date, key="", user=True):
        return rt.Row((0, 0), benchmark, "-", "-", "-", date, f"{benchmark}-{date}/", key, user)

    rows = [row("speed", "2026-11-27T02:28"), row("speed", "2026-11-27T19:20"), row("check", "2026-11-28", user=False),
            row("SFT stage", "2026-11-25T04:12", "stages"), row("DPO stage", "2026-11-25T11:43", "stages"),
            row("demo", "2026-11-28")]
    assert [r.report for r in rt.newest_of_each(rows)] == [
        "speed-2026-11-27T19:20/", "DPO stage-2026-11-25T11:43/", "demo-2026-11-28/"]


def test_check_fails_on_a_stale_table_and_the_rewrite_fixes_it(tmp_path, monkeypatch):
    results = tmp_path / "results"
    shutil.copytree(rt.RESULTS / "learning_margin-smollm2-135m-cpu", results / "learning_margin-smollm2-135m-cpu")
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{rt.START}\nold\n{rt.END}\nafter\n")
    monkeypatch.setattr(rt, "PAGES", {readme: rt.Page("results", summary=False)})
    monkeypatch.setattr(rt, "ROOT", tmp_path)
    with pytest.raises(rt.InputError, match="stale results table in README.md"):
        rt.main(["--check", "--results_dir", str(results)])
    rt.main(["--results_dir", str(results)])
    text = readme.read_text()
    assert text.startswith("intro\n") and text.endswith(f"{rt.END}\nafter\n")
    assert "[learning_margin-smollm2-135m-cpu](results/learning_margin-smollm2-135m-cpu/README.md)" in text
    rt.main(["--check", "--results_dir", str(results)])


def anchors(markdown: Path) -> set[str]:
    """GitHub's anchors of a Markdown file's headings: lower case, punctuation dropped, spaces as hyphens."""
    headings = re.findall(r"^#+ (.+)$", re.sub(r"```.*?```", "", markdown.read_text(), flags=re.S), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves_to_a_file_in_the_repository(doc):
    text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)  # commands in code blocks are not links
    targets = LINK.findall(text)
    broken = []
    for target in targets:
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        path = (doc.parent / file).resolve() if file else doc
        if not path.exists() or ROOT not in path.parents:
            broken.append(target)
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            broken.append(target)
    assert targets and not broken, f"{doc.relative_to(ROOT)}: links that resolve to no file or heading: {broken}"
