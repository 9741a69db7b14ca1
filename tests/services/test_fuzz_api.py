"""Schemathesis against a real edge process: generated requests from the edge's own OpenAPI
schema must never get a 5xx, and the service must keep serving afterwards."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from loadtest.processes import Service, edge_env, free_port, running
from loadtest.tiny_models import save_tiny_pair

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def edge(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    _, draft = save_tiny_pair(tmp_path_factory.mktemp("pair"))
    port = free_port()
    # draft-only: the API surface is the same in every mode, and no cloud is needed.
    env = edge_env(draft, port, free_port(), "draft-only", max_tokens_limit="16")
    with running("edge_gateway", port, env, tmp_path_factory.mktemp("logs")) as service:
        yield service


def test_generated_requests_never_get_a_5xx(edge: Service, tmp_path: Path) -> None:
    schemathesis = Path(sys.executable).with_name("schemathesis")
    result = subprocess.run(
        [
            str(schemathesis), "run", f"{edge.url}/openapi.json",
            "--checks", "not_a_server_error",
            "--max-examples", "40",
            "--seed", "1",
            "--report", "junit", "--report-dir", str(tmp_path),
        ],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    summary = result.stdout[-3000:]
    print(summary)  # the summary shows in the test log (and in CI's)
    assert result.returncode == 0, summary + result.stderr[-2000:]
    assert httpx.get(f"{edge.url}/health").status_code == 200
