"""The run's figures: throughput by mode × profile (the paper's Fig. 4) and the per-request
latency breakdown (Fig. 2). PNG, written with matplotlib's non-interactive backend."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only; never a display

import matplotlib.pyplot as plt

from loadtest.bench.report import BREAKDOWN
from loadtest.bench.tables import index_rows, ordered

Row = Mapping[str, Any]
_COLOURS = dict(
    zip(BREAKDOWN, ("#4c72b0", "#dd8452", "#937860", "#55a868", "#8172b3", "#c44e52"), strict=True)
)


def throughput_figure(
    rows: Sequence[Row], modes: Sequence[str], profiles: Sequence[str], path: Path
) -> None:
    """Grouped bars: one group per profile, one bar per mode, tokens/s (log axis when the
    modes span more than 30×, as baselines on a weak link do)."""
    cells = index_rows(r for r in rows if r.get("error") is None)
    width = 0.8 / max(1, len(modes))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(profiles) * len(modes) / 3), 4.2))
    values = []
    for i, mode in enumerate(modes):
        heights = [
            cells[(mode, p)]["throughput_tok_s"] if (mode, p) in cells else 0.0 for p in profiles
        ]
        values += [h for h in heights if h > 0]
        xs = [j + (i - (len(modes) - 1) / 2) * width for j in range(len(profiles))]
        ax.bar(xs, heights, width, label=mode)
    ax.set_xticks(range(len(profiles)), [p.capitalize() for p in profiles])
    ax.set_ylabel("output throughput (tokens/s)")
    if values and max(values) / min(values) > 30:
        ax.set_yscale("log")
    # Beside the axes, not over them: draft-only's bar is the tallest and sits at the right.
    ax.legend(fontsize=8, frameon=False, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.grid(axis="y", alpha=0.3)
    ax.set_title("Output-token throughput by mode and link profile")
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def breakdown_figure(rows: Sequence[Row], path: Path) -> None:
    """Stacked horizontal bars: mean request latency split into draft, upload, queue, verify,
    download and wait, one bar per (mode, profile)."""
    shown = [r for r in rows if r.get("error") is None and r.get("e2e_mean_s")]
    fig, ax = plt.subplots(figsize=(8, 0.32 * len(shown) + 1.6))
    labels = [f"{r['mode']} / {r['profile']}" for r in shown]
    left = [0.0] * len(shown)
    for part in BREAKDOWN:
        widths = [float(r.get(f"breakdown_{part}_s") or 0.0) for r in shown]
        ax.barh(labels, widths, left=left, color=_COLOURS[part], label=part)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    ax.invert_yaxis()
    ax.set_xlabel("mean end-to-end latency per request (s)")
    ax.legend(ncol=6, fontsize=8, frameon=False, loc="lower center", bbox_to_anchor=(0.5, 1.0))
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def write_plots(out_dir: Path, results: Mapping[str, Any]) -> list[Path]:
    rows, config = results["rows"], results["config"]
    modes = ordered((r["mode"] for r in rows), config["modes"])
    profiles = ordered((r["profile"] for r in rows), config["profiles"])
    paths = [out_dir / "throughput.png", out_dir / "breakdown.png"]
    throughput_figure(rows, modes, profiles, paths[0])
    breakdown_figure(rows, paths[1])
    return paths
