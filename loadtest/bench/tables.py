"""The run's machine- and human-readable outputs: results.json, results.csv, results.md.

results.json is ``{"config", "environment", "testbed_rates", "rows", "bars"}``; ``rows`` is
a list with one object per (mode, profile), the fields of ``report.summarize`` (see
REQUIRED_ROW_FIELDS for the ones every row has). The markdown shows each metric as in the
paper's Table II (modes × profiles, each value with its ratio to asymspec on the same
profile), each mode's throughput against the best baseline, the latency breakdown, the
measured link rates, and the issue's bars with the measurement behind each verdict.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from asymspec.modes import BASELINES
from loadtest.bench.report import BREAKDOWN

Row = Mapping[str, Any]
REFERENCE_MODE = "asymspec"
REQUIRED_ROW_FIELDS = (
    "mode", "profile", "throughput_tok_s", "ttft_p50_s", "tpot_p50_s", "e2e_p50_s",
    "uplink_bytes_per_token", "downlink_bytes_per_token", "target_calls_per_token",
    "mean_accepted_per_block",
)  # fmt: skip
# (field, title, how a value compares with asymspec's: "pct" = share of it, "x" = multiple)
TABLE_METRICS: tuple[tuple[str, str, str], ...] = (
    ("throughput_tok_s", "Throughput (tokens/s) ↑", "pct"),
    ("e2e_p50_s", "E2E latency p50 (s) ↓", "x"),
    ("ttft_p50_s", "TTFT p50 (s) ↓", "x"),
    ("tpot_p50_s", "TPOT p50 (s) ↓", "x"),
    ("uplink_bytes_per_token", "Uplink bytes per generated token ↓", "x"),
    ("downlink_bytes_per_token", "Downlink bytes per generated token ↓", "x"),
    ("target_calls_per_token", "Target forwards per generated token ↓", "x"),
    ("mean_accepted_per_block", "Mean accepted tokens per block ↑", "x"),
)


# ---------------------------------------------------------------------- formatting


def fmt_value(value: float | None) -> str:
    """Three significant digits, plain notation in the usual ranges; '—' for no value."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    if value == 0:
        return "0"
    magnitude = abs(value)
    if magnitude >= 1000:
        return f"{value:,.0f}"
    if magnitude >= 0.01:
        return f"{value:.3g}" if magnitude < 100 else f"{value:.1f}"
    return f"{value:.2e}"


def fmt_ratio(value: float | None, reference: float | None, kind: str) -> str:
    """``value (ratio)``: a percentage of the reference ('pct') or a multiple of it ('x')."""
    text = fmt_value(value)
    if value is None or not reference:
        return text
    ratio = value / reference
    return f"{text} ({100 * ratio:.1f}%)" if kind == "pct" else f"{text} ({ratio:.2f}×)"


def markdown_table(header: Sequence[str], lines: Iterable[Sequence[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(line) + " |" for line in lines]
    return "\n".join(out)


# ---------------------------------------------------------------------- lookups


def index_rows(rows: Iterable[Row]) -> dict[tuple[str, str], Row]:
    return {(row["mode"], row["profile"]): row for row in rows}


def ordered(values: Iterable[str], preferred: Sequence[str]) -> list[str]:
    seen = list(dict.fromkeys(values))
    return [v for v in preferred if v in seen] + [v for v in seen if v not in preferred]


def best_baseline(rows: Iterable[Row], profile: str) -> Row | None:
    """The baseline (standard, full-upload, pipeinfer) with the highest throughput."""
    candidates = [r for r in rows if r["profile"] == profile and r["mode"] in BASELINES and _ok(r)]
    return max(candidates, key=lambda r: r["throughput_tok_s"], default=None)


def _ok(row: Row) -> bool:
    return row.get("error") is None and row.get("throughput_tok_s") is not None


# ---------------------------------------------------------------------- markdown sections


def metric_tables(rows: Sequence[Row], modes: Sequence[str], profiles: Sequence[str]) -> str:
    cells = index_rows(rows)
    parts = []
    for field, title, kind in TABLE_METRICS:
        lines = []
        for mode in modes:
            line = [mode]
            for profile in profiles:
                row, ref = cells.get((mode, profile)), cells.get((REFERENCE_MODE, profile))
                value = None if row is None else row.get(field)
                reference = None if ref is None else ref.get(field)
                line.append(fmt_ratio(value, reference, kind))
            lines.append(line)
        parts.append(f"**{title}** (ratio to asymspec on the same profile)\n\n")
        parts[-1] += markdown_table(["mode", *profiles], lines)
    return "\n\n".join(parts)


def baseline_table(rows: Sequence[Row], modes: Sequence[str], profiles: Sequence[str]) -> str:
    cells = index_rows(rows)
    best = {p: best_baseline(rows, p) for p in profiles}
    header = ["mode", *(f"{p} (best: {b['mode'] if b else '—'})" for p, b in best.items())]
    lines = []
    for mode in modes:
        line = [mode]
        for profile in profiles:
            row, ref = cells.get((mode, profile)), best[profile]
            if row is None or ref is None or not _ok(row) or not ref["throughput_tok_s"]:
                line.append("—")
            else:
                line.append(f"{row['throughput_tok_s'] / ref['throughput_tok_s']:.2f}×")
        lines.append(line)
    return markdown_table(header, lines)


def detail_table(rows: Sequence[Row]) -> str:
    columns: tuple[tuple[str, str, Callable[[Any], str]], ...] = (
        ("mode", "mode", str),
        ("profile", "profile", str),
        ("throughput_tok_s", "tok/s", fmt_value),
        ("e2e_p90_s", "e2e p90", fmt_value),
        ("ttft_p90_s", "TTFT p90", fmt_value),
        ("tpot_p90_s", "TPOT p90", fmt_value),
        ("uplink_block_bytes_per_token", "up B/tok (blocks)", fmt_value),
        ("uplink_session_bytes_per_token", "up B/tok (sessions)", fmt_value),
        ("target_sequence_calls_per_token", "target seq calls/tok", fmt_value),
        ("acceptance_rate", "accept rate", fmt_value),
        ("mean_verify_batch", "verify batch", fmt_value),
        ("corrections_topk", "corr topk", fmt_value),
        ("corrections_proposals", "corr prop", fmt_value),
        ("corrections_full", "corr full", fmt_value),
        ("corrections_cloud", "corr cloud", fmt_value),
        ("correction_rounds", "escalations", fmt_value),
        ("fidelity_spent", "ε spent", fmt_value),
        ("wasted_draft_tokens", "wasted drafts", fmt_value),
        ("edge_utilisation", "edge util", fmt_value),
        ("cloud_utilisation", "cloud util", fmt_value),
        ("failed", "failed", str),
    )
    lines = [[f(row.get(key)) for key, _, f in columns] for row in rows]
    return markdown_table([title for _, title, _ in columns], lines)


def breakdown_table(rows: Sequence[Row]) -> str:
    header = ["mode", "profile", *BREAKDOWN, "e2e mean", "edge idle s"]
    lines = []
    for row in rows:
        parts = [row.get(f"breakdown_{k}_s") for k in BREAKDOWN]
        lines.append(
            [row["mode"], row["profile"], *(fmt_value(v) for v in parts),
             fmt_value(row.get("e2e_mean_s")), fmt_value(row.get("edge_idle_s"))]
        )  # fmt: skip
    return markdown_table(header, lines)


def rates_table(rates: Mapping[str, Sequence[Mapping[str, Any]]]) -> str:
    lines = []
    for profile, checks in rates.items():
        for check in checks:
            lines.append(
                [profile, str(check["direction"]), fmt_value(check.get("profile_mbit_s")),
                 fmt_value(check.get("measured_mbit_s")), fmt_value(check.get("ratio")),
                 "yes" if check.get("ok") else "NO"]
            )  # fmt: skip
    header = ["profile", "direction", "set Mbit/s", "measured Mbit/s", "ratio", "within 10%"]
    return markdown_table(header, lines)


# ---------------------------------------------------------------------- the bars


def _bar(name: str, value: float | None, target: str, met: bool | None) -> dict[str, Any]:
    return {"bar": name, "value": value, "target": target, "met": met}


def _worst(rows: Sequence[Row], field: str) -> float | None:
    return max((r[field] for r in rows if r.get(field) is not None), default=None)


def _throughput_bars(cells: Mapping[tuple[str, str], Row], rows: Sequence[Row]) -> list[dict]:
    """Issue #13's throughput bars: >= 5x the best baseline on Weak and >= 1.5x on Strong,
    within 5 % from Strong to Weak, and never below target-only on any profile measured."""
    out = []
    for profile, needed in (("weak", 5.0), ("strong", 1.5)):
        ours, best = cells.get((REFERENCE_MODE, profile)), best_baseline(rows, profile)
        ratio = None
        if ours is not None and best is not None and best["throughput_tok_s"]:
            ratio = ours["throughput_tok_s"] / best["throughput_tok_s"]
        met = None if ratio is None else ratio >= needed
        out.append(_bar(f"asymspec / best baseline throughput, {profile}", ratio,
                        f">= {needed}×", met))  # fmt: skip
    strong, weak = cells.get((REFERENCE_MODE, "strong")), cells.get((REFERENCE_MODE, "weak"))
    change = None
    if strong is not None and weak is not None and strong["throughput_tok_s"]:
        change = weak["throughput_tok_s"] / strong["throughput_tok_s"] - 1
    met = None if change is None else abs(change) <= 0.05
    out.append(_bar("asymspec throughput change strong -> weak", change, "|Δ| <= 5%", met))
    versus = [
        ours["throughput_tok_s"] / target["throughput_tok_s"]
        for (mode, profile), ours in cells.items()
        if mode == REFERENCE_MODE
        and (target := cells.get(("target-only", profile))) is not None
        and target["throughput_tok_s"]
    ]
    worst = min(versus, default=None)
    out.append(_bar("asymspec / target-only throughput (worst profile)", worst, ">= 1×",
                    None if worst is None else worst >= 1))  # fmt: skip
    return out


def _savings(cells: Mapping[tuple[str, str], Row], ours: Sequence[Row], field: str) -> float | None:
    """The smallest share of target calls asymspec saves against target-only, per profile."""
    savings = []
    for row in ours:
        target = cells.get(("target-only", row["profile"]))
        if target is not None and target.get(field) and row.get(field) is not None:
            savings.append(1 - row[field] / target[field])
    return min(savings, default=None)


def _cost_bars(cells: Mapping[tuple[str, str], Row], ours: Sequence[Row]) -> list[dict]:
    up = _worst(ours, "uplink_bytes_per_token")
    blocks = _worst(ours, "uplink_block_bytes_per_token")
    out = [
        _bar("asymspec uplink bytes per token (worst profile)", up, "<= 16",
             None if up is None else up <= 16),
        # The same without the prompt upload and session close: what the blocks cost.
        _bar("  of which per-block traffic (prompt upload excluded)", blocks, "<= 16",
             None if blocks is None else blocks <= 16),
    ]  # fmt: skip
    # Two readings of "target calls": batched forwards (one forward verifies many requests'
    # blocks, and target-only decodes many requests per forward too), and per-request
    # invocations as SPADE counts them (target-only = one per token).
    for field, what in (
        ("target_calls_per_token", "batched target forwards"),
        ("target_sequence_calls_per_token", "per-request target calls"),
    ):
        calls, saved = _worst(ours, field), _savings(cells, ours, field)
        out += [
            _bar(f"asymspec {what} per token (worst profile)", calls, "<= 0.4",
                 None if calls is None else calls <= 0.4),
            _bar(f"asymspec {what} saved vs target-only (worst profile)", saved, ">= 60%",
                 None if saved is None else saved >= 0.6),
        ]  # fmt: skip
    return out


def bars(rows: Sequence[Row], rates: Mapping[str, Sequence[Mapping[str, Any]]]) -> list[dict]:
    """The issue's acceptance bars, each with the measured value behind the verdict.

    ``met`` is None when the run lacks the cells a bar needs."""
    cells = index_rows(r for r in rows if _ok(r))
    ours = [r for r in rows if r["mode"] == REFERENCE_MODE and _ok(r)]
    ratios = [c["ratio"] for checks in rates.values() for c in checks if c.get("ratio")]
    worst_rate = max(ratios, key=lambda r: abs(r - 1), default=None)
    rate_bar = _bar("testbed rate / profile rate (worst direction)", worst_rate, "within ±10%",
                    None if worst_rate is None else abs(worst_rate - 1) <= 0.10)  # fmt: skip
    return [*_throughput_bars(cells, rows), *_cost_bars(cells, ours), rate_bar]


def bars_table(results: Sequence[Mapping[str, Any]]) -> str:
    verdict = {True: "met", False: "MISSED", None: "not measured"}
    lines = [[b["bar"], fmt_value(b["value"]), b["target"], verdict[b["met"]]] for b in results]
    return markdown_table(["bar", "measured", "target", "verdict"], lines)


# ---------------------------------------------------------------------- files


def render_markdown(results: Mapping[str, Any]) -> str:
    rows, config = results["rows"], results["config"]
    modes = ordered((r["mode"] for r in rows), config["modes"])
    profiles = ordered((r["profile"] for r in rows), config["profiles"])
    sampling = config["sampling"]
    env = results.get("environment", {})
    budget = sampling["fidelity_budget"]
    head = (
        f"# Benchmark {Path(config['out']).name}\n\n"
        f"{config['models']} models; {config.get('workload', 'humaneval')} workload, "
        f"{config['requests']} requests (agent: conversations) at concurrency "
        f"{config['concurrency']} per cell (after {config['warmup']} warm-up), max_tokens "
        f"{sampling['max_tokens']}, temperature {sampling['temperature']}, fidelity budget "
        f"{budget if budget is not None else 'edge default'}"
        f", γ {sampling['num_draft_tokens'] or 'edge default'}. "
        f"Load average at start: {env.get('loadavg_start', '—')}, at end: "
        f"{env.get('loadavg_end', '—')}.\n"
    )
    failed = [r for r in rows if r.get("error")]
    sections = [
        head,
        "## Bars\n\n" + bars_table(results["bars"]),
        "## Per metric (Table II style)\n\n" + metric_tables(rows, modes, profiles),
        "## Throughput vs the best baseline (standard, full-upload, pipeinfer)\n\n"
        + baseline_table(rows, modes, profiles),
        "## Latency breakdown per request (s; Fig. 2)\n\n" + breakdown_table(rows),
        "## Details\n\n" + detail_table(rows),
        "## Testbed rates (TCP goodput through the shaped veth)\n\n"
        + rates_table(results["testbed_rates"]),
    ]
    if failed:
        sections.append(
            "## Failed cells\n\n"
            + "\n".join(f"- {r['mode']} / {r['profile']}: {r['error'][:300]}" for r in failed)
        )
    return "\n\n".join(sections) + "\n"


def _csv_value(value: Any) -> Any:
    return json.dumps(value) if isinstance(value, dict | list) else value


def write_csv(path: Path, rows: Sequence[Row]) -> None:
    fields = list(dict.fromkeys(key for row in rows for key in row))
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: _csv_value(v) for k, v in row.items()})


def write_outputs(out_dir: Path, results: Mapping[str, Any]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    write_csv(out_dir / "results.csv", results["rows"])
    (out_dir / "results.md").write_text(render_markdown(results))


def check_rows(rows: Iterable[Row]) -> None:
    """results.json's row schema: every successful row has the required fields."""
    for row in rows:
        if row.get("error") is not None:
            continue
        missing = [f for f in REQUIRED_ROW_FIELDS if f not in row]
        if missing:
            raise ValueError(f"{row.get('mode')}/{row.get('profile')} lacks {missing}")
