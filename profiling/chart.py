"""PNG chart: one stacked bar per phase (components stacked), against a line at the memory budget."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display on training machines
import matplotlib.pyplot as plt  # noqa: E402

from profiling import components as C  # noqa: E402

FIGSIZE = (11.0, 6.0)  # inches
DPI = 100  # so the PNG is exactly 1100 x 600 pixels
_PALETTE = plt.get_cmap("tab20").colors


def _colour(component: str, index: dict[str, int]) -> tuple:
    if component not in index:
        index[component] = len(index)
    return _PALETTE[index[component] % len(_PALETTE)]


def phase_label(phase: dict) -> str:
    return f"{phase['stage']}\n{phase['phase']}"


def write_chart(phases: list[dict], path: Path, budget_bytes: int, title: str) -> Path:
    """Stacked bars in GiB; components that could not be measured (None) are named under the bar."""
    names = C.ordered(c for p in phases for c in p["components"])
    colours: dict[str, int] = {}
    fig, ax = plt.subplots(figsize=FIGSIZE, dpi=DPI)
    x = range(len(phases))
    bottoms = [0.0] * len(phases)
    for component in names:
        heights = [(p["components"].get(component) or 0) / C.GIB for p in phases]
        if not any(heights):
            continue
        ax.bar(x, heights, bottom=bottoms, color=_colour(component, colours), label=component, width=0.6)
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    budget = budget_bytes / C.GIB
    ax.axhline(budget, color="crimson", linestyle="--", linewidth=1.5, label=f"budget {budget:g} GiB")
    for i, phase in enumerate(phases):
        unmeasured = [c for c, v in phase["components"].items() if v is None]
        note = f"{bottoms[i]:.2f}" + ("\n+ GPU-only parts\nnot measured" if unmeasured else "")
        ax.text(i, bottoms[i], note, ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(x), [phase_label(p) for p in phases], fontsize=8)
    ax.set_ylabel("device memory, GiB (2^30 bytes)")
    ax.set_ylim(0, max([budget, *bottoms]) * 1.15)
    ax.set_title(title, fontsize=10)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    fig.subplots_adjust(left=0.07, right=0.77, bottom=0.14, top=0.92)
    path = Path(path)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path
