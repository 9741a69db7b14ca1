"""Formatting, ratios against asymspec and the best baseline, the bars, and the files."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import pytest

from loadtest.bench.config import BenchConfig, parse_list
from loadtest.bench.plots import write_plots
from loadtest.bench.tables import (
    bars,
    baseline_table,
    best_baseline,
    fmt_ratio,
    fmt_value,
    markdown_table,
    metric_tables,
    write_outputs,
)


def row(mode: str, profile: str, tok_s: float, **extra: Any) -> dict[str, Any]:
    base = {
        "mode": mode, "profile": profile, "throughput_tok_s": tok_s, "error": None,
        "ttft_p50_s": 0.5, "tpot_p50_s": 0.05, "e2e_p50_s": 3.0, "e2e_mean_s": 3.0,
        "uplink_bytes_per_token": 20.0, "uplink_block_bytes_per_token": 12.0,
        "downlink_bytes_per_token": 30.0, "target_calls_per_token": 0.3,
        "mean_accepted_per_block": 2.0,
    }  # fmt: skip
    return {**base, **extra}


ROWS = [
    row("asymspec", "weak", 60.0),
    row("standard", "weak", 10.0),
    row("full-upload", "weak", 15.0),
    row("pipeinfer", "weak", 12.0),
    row("target-only", "weak", 20.0, target_calls_per_token=1.0),
    row("asymspec", "strong", 66.0),
    row("standard", "strong", 50.0),
    {"mode": "full-upload", "profile": "strong", "error": "cloud exited (1)"},
]
RATES = {
    "weak": [
        {"direction": "uplink", "profile_mbit_s": 50, "measured_mbit_s": 47.6, "ratio": 0.952,
         "ok": True},
        {"direction": "downlink", "profile_mbit_s": 150, "measured_mbit_s": 143.7,
         "ratio": 0.958, "ok": True},
    ]
}  # fmt: skip


def test_fmt_value_and_ratio() -> None:
    assert fmt_value(None) == "—"
    assert fmt_value(0) == "0"
    assert fmt_value(12.345) == "12.3"
    assert fmt_value(393255.0) == "393,255"
    assert fmt_value(0.000123) == "1.23e-04"
    assert fmt_ratio(30.0, 60.0, "pct") == "30 (50.0%)"
    assert fmt_ratio(6.0, 3.0, "x") == "6 (2.00×)"
    assert fmt_ratio(6.0, None, "x") == "6"


def test_markdown_table_shape() -> None:
    text = markdown_table(["a", "b"], [["1", "2"], ["3", "4"]])
    assert text.splitlines() == ["| a | b |", "|---|---|", "| 1 | 2 |", "| 3 | 4 |"]


def test_best_baseline_skips_failed_cells_and_non_baselines() -> None:
    best = best_baseline(ROWS, "weak")
    assert best is not None and best["mode"] == "full-upload"  # target-only is no baseline
    strong = best_baseline(ROWS, "strong")
    assert strong is not None and strong["mode"] == "standard"  # full-upload failed there
    assert best_baseline(ROWS, "medium") is None


def test_tables_show_ratios_to_asymspec_and_to_the_best_baseline() -> None:
    text = metric_tables(ROWS, ["asymspec", "standard"], ["weak", "strong"])
    assert "| standard | 10 (16.7%) | 50 (75.8%) |" in text
    assert "| asymspec | 60 (100.0%) | 66 (100.0%) |" in text
    versus = baseline_table(ROWS, ["asymspec", "full-upload"], ["weak", "strong"])
    assert "weak (best: full-upload)" in versus and "strong (best: standard)" in versus
    assert "| asymspec | 4.00× | 1.32× |" in versus
    assert "| full-upload | 1.00× | — |" in versus


def test_bars_report_each_measurement() -> None:
    verdicts = {b["bar"]: b for b in bars(ROWS, RATES)}
    weak = verdicts["asymspec / best baseline throughput, weak"]
    assert weak["value"] == pytest.approx(4.0) and weak["met"] is False  # the bar is 5x
    strong = verdicts["asymspec / best baseline throughput, strong"]
    assert strong["value"] == pytest.approx(1.32) and strong["met"] is False  # 1.5x
    change = verdicts["asymspec throughput change strong -> weak"]
    assert change["value"] == pytest.approx(60 / 66 - 1) and change["met"] is False  # 5 %
    versus = verdicts["asymspec / target-only throughput (worst profile)"]
    assert versus["value"] == pytest.approx(3.0) and versus["met"] is True  # weak only
    slower = [*ROWS, row("target-only", "strong", 70.0)]
    worst = {b["bar"]: b for b in bars(slower, RATES)}
    assert worst["asymspec / target-only throughput (worst profile)"]["met"] is False
    assert worst["asymspec / target-only throughput (worst profile)"]["value"] == (
        pytest.approx(66 / 70)
    )
    assert verdicts["asymspec uplink bytes per token (worst profile)"]["met"] is False
    saved = verdicts["asymspec batched target forwards saved vs target-only (worst profile)"]
    assert saved["value"] == pytest.approx(0.7) and saved["met"] is True
    calls = verdicts["asymspec per-request target calls per token (worst profile)"]
    assert calls["met"] is None  # the rows lack target_sequence_calls_per_token
    assert verdicts["testbed rate / profile rate (worst direction)"]["value"] == 0.952
    assert bars([], {})[0]["met"] is None  # nothing measured: no verdict


def test_write_outputs_and_plots(tmp_path: Path) -> None:
    config = BenchConfig(modes=("asymspec", "standard"), profiles=("weak",), out=tmp_path)
    rows = [r for r in ROWS if r["mode"] in config.modes and r["profile"] == "weak"]
    for r in rows:
        r.update({f"breakdown_{k}_s": 0.5 for k in ("draft", "upload", "verify", "wait")})
    results = {
        "config": config.to_json(), "environment": {}, "testbed_rates": RATES,
        "rows": rows, "bars": bars(rows, RATES),
    }  # fmt: skip
    write_outputs(tmp_path, results)
    paths = write_plots(tmp_path, results)
    loaded = json.loads((tmp_path / "results.json").read_text())
    assert [r["mode"] for r in loaded["rows"]] == ["asymspec", "standard"]
    assert loaded["config"]["sampling"]["max_tokens"] == 64
    with (tmp_path / "results.csv").open() as handle:
        assert [r["mode"] for r in csv.DictReader(handle)] == ["asymspec", "standard"]
    markdown = (tmp_path / "results.md").read_text()
    assert "## Bars" in markdown and "Testbed rates" in markdown
    assert all(p.stat().st_size > 1000 for p in paths)


def test_config_validation_and_lists() -> None:
    assert parse_list("asymspec, standard", ()) == ("asymspec", "standard")
    assert parse_list("all", ("a", "b")) == ("a", "b")
    with pytest.raises(ValueError, match="unknown modes"):
        BenchConfig(modes=("asymspec", "turbo"))
    with pytest.raises(ValueError, match="unknown profiles"):
        BenchConfig(profiles=("lte",))
