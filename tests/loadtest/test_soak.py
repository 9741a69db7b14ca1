"""The CI version of the soak: one minute of Locust over the Weak testbed (root only)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from loadtest.soak import run_soak

pytestmark = pytest.mark.slow


@pytest.mark.skipif(os.geteuid() != 0, reason="the testbed needs root (network namespaces)")
def test_one_minute_soak_over_weak_link(tmp_path: Path) -> None:
    report = run_soak(minutes=1, users=8, profile="weak", models="tiny", out=tmp_path)
    print(report.markdown())
    assert report.locust_exit_code == 0 and report.failures == 0 and report.requests > 0
    assert report.sessions_after == 0
    assert max(s.cloud_sessions for s in report.samples) <= 8  # one open session per user
    for side in ("edge", "cloud"):
        assert abs(report.drift(side)) <= report.rss_tolerance, (side, report.drift(side))
