"""`python -m loadtest.bench` end to end (root, slow): the tiny pair, asymspec and standard on
the weak profile, real processes in the namespace testbed; the outputs exist and agree."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from loadtest.bench.config import REPO_ROOT
from loadtest.bench.tables import REQUIRED_ROW_FIELDS
from tests.netem.conftest import netns_names, netns_unavailable_reason

REQUESTS, MAX_TOKENS = 4, 24


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_bench_smoke_run(tmp_path: Path) -> None:
    reason = netns_unavailable_reason()
    if reason is not None:
        pytest.skip(f"the bench runs in network namespaces: {reason}")
    before = netns_names()
    argv = [
        sys.executable, "-m", "loadtest.bench", "--models", "tiny",
        "--modes", "asymspec,standard", "--profiles", "weak",
        "--requests", str(REQUESTS), "--concurrency", "2", "--max-tokens", str(MAX_TOKENS),
        "--warmup", "1", "--rate-check-s", "1", "--out", str(tmp_path),
    ]  # fmt: skip
    done = subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True, timeout=220)
    assert done.returncode == 0, done.stderr[-3000:]
    assert netns_names() == before  # the testbed is gone

    for name in ("results.json", "results.csv", "results.md", "throughput.png", "breakdown.png"):
        assert (tmp_path / name).stat().st_size > 0, name
    results = json.loads((tmp_path / "results.json").read_text())
    rows = {row["mode"]: row for row in results["rows"]}
    assert set(rows) == {"asymspec", "standard"}
    for mode, row in rows.items():
        assert row["error"] is None and row["failed"] == 0, (mode, row.get("request_errors"))
        assert set(REQUIRED_ROW_FIELDS) <= set(row)
        assert row["generated_tokens"] == REQUESTS * MAX_TOKENS  # EOS ignored: exact counts
        assert row["server_generated_tokens"] == row["generated_tokens"]
        assert row["throughput_tok_s"] > 0 and row["blocks"] > 0
        assert row["ttft_p50_s"] <= row["e2e_p50_s"]
    # The point of the compact uplink: q(x) per draft token instead of the whole q row.
    assert rows["asymspec"]["uplink_bytes_per_token"] < rows["standard"]["uplink_bytes_per_token"]
    assert rows["standard"]["corrections_cloud"] > 0 and rows["asymspec"]["corrections_cloud"] == 0
    rates = results["testbed_rates"]["weak"]
    assert {r["direction"] for r in rates} == {"uplink", "downlink"}
    assert "asymspec / best baseline throughput, weak" in (tmp_path / "results.md").read_text()
