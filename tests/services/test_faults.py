"""Faults through real processes: the cloud dies and comes back, stays down, a client
leaves mid-stream. Every request either finishes with the same output an uninterrupted run
gives (greedy) or ends with a clear error; nothing hangs and nothing leaks."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.services.processes import (
    SHARED_SECRET,
    Service,
    cloud_env,
    edge_env,
    free_port,
    running,
)
from tests.services.tiny_models import save_tiny_pair

pytestmark = pytest.mark.slow
PROMPTS = [f"request {i}: def f(x):" for i in range(4)]


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return save_tiny_pair(tmp_path_factory.mktemp("pair"))


@pytest.fixture()
def logs(tmp_path: Path) -> Path:
    return tmp_path


def greedy(prompt: str, max_tokens: int) -> dict:
    return {
        "model": "asymspec", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, "stream": True,
    }  # fmt: skip


async def stream_text(client: httpx.AsyncClient, body: dict, first: asyncio.Event) -> str:
    """The streamed completion text; raises if the stream carried an error event."""
    text = ""
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            text += chunk["choices"][0]["text"]
            first.set()
    return text


def cloud_sessions(cloud_port: int) -> int:
    response = httpx.get(
        f"http://127.0.0.1:{cloud_port}/v1/sessions",
        headers={"Authorization": f"Bearer {SHARED_SECRET}"},
    )
    assert response.status_code == 200
    return int(response.json()["sessions"])


@pytest.fixture()
def cluster(pair: tuple[Path, Path], logs: Path) -> Iterator[tuple[int, Service, dict[str, str]]]:
    cloud_port, edge_port = free_port(), free_port()
    env = edge_env(pair[1], edge_port, cloud_port, "asymspec", cloud_deadline_s="60")
    cloud = Service("cloud_verifier", cloud_port, cloud_env(pair[0], cloud_port), logs / "c.log")
    try:
        cloud.wait_healthy()
        with running("edge_gateway", edge_port, env, logs) as edge:
            yield cloud_port, edge, {"cloud_log": str(logs / "c2.log")}
    finally:
        cloud.stop()


def test_cloud_killed_mid_stream_and_restarted(pair: tuple[Path, Path], logs: Path) -> None:
    cloud_port, edge_port = free_port(), free_port()
    cloud = Service("cloud_verifier", cloud_port, cloud_env(pair[0], cloud_port), logs / "c1.log")
    cloud.wait_healthy()
    env = edge_env(pair[1], edge_port, cloud_port, "asymspec", cloud_deadline_s="60")
    restarted: Service | None = None
    try:
        with running("edge_gateway", edge_port, env, logs) as edge:

            async def run() -> tuple[list[str], list[str]]:
                async with httpx.AsyncClient(base_url=edge.url, timeout=120) as client:
                    firsts = [asyncio.Event() for _ in PROMPTS]
                    streams = [
                        asyncio.create_task(stream_text(client, greedy(p, 300), f))
                        for p, f in zip(PROMPTS, firsts, strict=True)
                    ]
                    await asyncio.gather(*(f.wait() for f in firsts))
                    cloud.kill()  # mid-stream: every request has output and more to come
                    nonlocal restarted
                    await asyncio.sleep(1.0)
                    restarted = Service(
                        "cloud_verifier", cloud_port, cloud_env(pair[0], cloud_port),
                        logs / "c2.log",
                    )  # fmt: skip
                    interrupted = await asyncio.gather(*streams)
                    reference = await asyncio.gather(
                        *(stream_text(client, greedy(p, 300), asyncio.Event()) for p in PROMPTS)
                    )
                    return list(interrupted), list(reference)

            interrupted, reference = asyncio.run(run())
            assert interrupted == reference  # token-identical to an uninterrupted run
            assert all(len(text) > 0 for text in interrupted)
            metrics = httpx.get(f"{edge.url}/metrics").text
            assert "asymspec_cloud_session_reopens_total" in metrics
    finally:
        if restarted is not None:
            restarted.stop()


def test_cloud_down_past_the_deadline_ends_requests_with_errors(
    pair: tuple[Path, Path], logs: Path
) -> None:
    cloud_port, edge_port = free_port(), free_port()
    cloud = Service("cloud_verifier", cloud_port, cloud_env(pair[0], cloud_port), logs / "c.log")
    cloud.wait_healthy()
    env = edge_env(pair[1], edge_port, cloud_port, "asymspec", cloud_deadline_s="2")
    with running("edge_gateway", edge_port, env, logs) as edge:
        with httpx.stream(
            "POST", f"{edge.url}/v1/completions", json=greedy("x", 1000), timeout=30
        ) as response:
            events: list[str] = []
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                if not events:
                    cloud.kill()  # mid-stream, and it never comes back
                    started = time.monotonic()
                events.append(line)
        assert events[-1] == "data: [DONE]", events[-3:]
        assert "error" in json.loads(events[-2].removeprefix("data: ")), events[-3:]
        assert time.monotonic() - started < 20  # bounded by the 2 s deadline, not hanging
        plain = httpx.post(
            f"{edge.url}/v1/completions", json={**greedy("x", 5), "stream": False}, timeout=30
        )
        assert plain.status_code == 503 and plain.json()["error"]["message"]
        health = httpx.get(f"{edge.url}/health")
        assert health.status_code == 503 and "cloud" in health.json()["reason"]


def test_client_disconnect_frees_sessions_on_both_sides(
    cluster: tuple[int, Service, dict[str, str]],
) -> None:
    cloud_port, edge, _ = cluster
    with httpx.stream(
        "POST", f"{edge.url}/v1/completions", json=greedy("leave early", 1000), timeout=30
    ) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                break  # read one chunk, then hang up mid-stream
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and cloud_sessions(cloud_port) > 0:
        time.sleep(0.1)
    assert cloud_sessions(cloud_port) == 0
    metrics = httpx.get(f"{edge.url}/metrics").text
    running_line = next(
        line for line in metrics.splitlines() if line.startswith("asymspec_num_requests_running")
    )
    assert float(running_line.split()[-1]) == 0


def test_control_route_needs_the_secret(cluster: tuple[int, Service, dict[str, str]]) -> None:
    cloud_port, _, _ = cluster
    response = httpx.get(f"http://127.0.0.1:{cloud_port}/v1/sessions")
    assert response.status_code == 401
