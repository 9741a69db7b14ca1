"""Faults through real processes, phase by phase: the cloud dies while sessions open
(prefill), mid-stream (mid-block), between requests, or stays down; one of two replicas
dies; a client leaves while its session opens or mid-stream. Every request either finishes
with the same output an uninterrupted run gives (greedy) or ends with a clear error after
the deadline; nothing hangs and nothing leaks."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from loadtest.processes import (
    SHARED_SECRET,
    Service,
    cloud_env,
    edge_env,
    free_port,
    running,
    wait_for_replicas,
)
from loadtest.tiny_models import save_tiny_pair

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


def edge_counter(edge: Service, name: str) -> float:
    metrics = httpx.get(f"{edge.url}/metrics").text
    return sum(float(x.split()[-1]) for x in metrics.splitlines() if x.startswith(name))


def assert_nothing_left_open(cloud_port: int, edge: Service) -> None:
    """Within 10 s no session is open on the cloud and no request is running on the edge."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and cloud_sessions(cloud_port) > 0:
        time.sleep(0.1)
    assert cloud_sessions(cloud_port) == 0
    assert edge_counter(edge, "asymspec_num_requests_running") == 0


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


@contextmanager
def killable_cloud(
    pair: tuple[Path, Path], logs: Path, mode: str = "asymspec", **edge_extra: str
) -> Iterator[tuple[Service, Service, Callable[[], None]]]:
    """A cloud for the test to kill, an edge on it (60 s deadline), and `restart`, which
    starts a new cloud on the same port; everything is stopped afterwards."""
    cloud_port, edge_port = free_port(), free_port()
    cloud = start_cloud(pair, cloud_port, logs / "cloud-0.log")
    cloud.wait_healthy()
    env = edge_env(pair[1], edge_port, cloud_port, mode, cloud_deadline_s="60", **edge_extra)
    restarted: list[Service] = []

    def restart() -> None:
        log = logs / f"cloud-{len(restarted) + 1}.log"
        restarted.append(start_cloud(pair, cloud_port, log))

    try:
        with running("edge_gateway", edge_port, env, logs) as edge:
            yield cloud, edge, restart
    finally:
        for service in (cloud, *restarted):
            service.stop()


def start_cloud(pair: tuple[Path, Path], port: int, log: Path) -> Service:
    return Service("cloud_verifier", port, cloud_env(pair[0], port), log)


Fault = Callable[[list[asyncio.Event]], Awaitable[None]]


async def streams_and_reference(
    edge: Service, prompts: list[str], max_tokens: int, fault: Fault
) -> tuple[list[str], list[str]]:
    """Start one greedy stream per prompt, run ``fault`` (given each stream's first-output
    event, it decides when to strike), let the streams finish, then run the same requests
    again undisturbed."""
    async with httpx.AsyncClient(base_url=edge.url, timeout=120) as client:
        firsts = [asyncio.Event() for _ in prompts]
        streams = [
            asyncio.create_task(stream_text(client, greedy(p, max_tokens), first))
            for p, first in zip(prompts, firsts, strict=True)
        ]
        await fault(firsts)
        interrupted = await asyncio.gather(*streams)
        reference = await asyncio.gather(
            *(stream_text(client, greedy(p, max_tokens), asyncio.Event()) for p in prompts)
        )
        return list(interrupted), list(reference)


def kill_then_restart(
    cloud: Service, restart: Callable[[], None], after_s: float = 0.0, mid_stream: bool = False
) -> Fault:
    """A fault: kill the cloud ``after_s`` into the streams (or once every stream has
    output, with ``mid_stream``), and start it again 1 s later."""

    async def fault(firsts: list[asyncio.Event]) -> None:
        if mid_stream:
            await asyncio.gather(*(first.wait() for first in firsts))
        await asyncio.sleep(after_s)
        cloud.kill()
        await asyncio.sleep(1.0)
        restart()

    return fault


def reopens(edge: Service) -> float:
    return edge_counter(edge, "asymspec_cloud_session_reopens_total")


def test_cloud_killed_mid_stream_and_restarted(pair: tuple[Path, Path], logs: Path) -> None:
    """Phase: mid-block. Every stream has output and more to come when the cloud dies."""
    with killable_cloud(pair, logs) as (cloud, edge, restart):
        interrupted, reference = asyncio.run(
            streams_and_reference(
                edge, PROMPTS, 300, kill_then_restart(cloud, restart, mid_stream=True)
            )
        )
        assert interrupted == reference and all(interrupted)  # token-identical
        assert reopens(edge) >= 1


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
    assert_nothing_left_open(cloud_port, edge)


def test_control_route_needs_the_secret(cluster: tuple[int, Service, dict[str, str]]) -> None:
    cloud_port, _, _ = cluster
    response = httpx.get(f"http://127.0.0.1:{cloud_port}/v1/sessions")
    assert response.status_code == 401


# A prompt long enough that its session is still opening when the cloud is frozen.
LONG_PROMPTS = [f"request {i}: " + "def f(x): return x + 1\n" * 40 for i in range(3)]


@pytest.mark.parametrize("mode", ["asymspec", "target-only"])
def test_cloud_killed_while_sessions_open(pair: tuple[Path, Path], logs: Path, mode: str) -> None:
    """Phase: session open / prefill. The cloud is frozen (SIGSTOP) so that the requests'
    OpenSession frames are in flight, unanswered, when it is killed and started again."""
    with killable_cloud(pair, logs, mode) as (cloud, edge, restart):
        cloud.proc.send_signal(signal.SIGSTOP)
        interrupted, reference = asyncio.run(
            streams_and_reference(edge, LONG_PROMPTS, 40, kill_then_restart(cloud, restart, 0.5))
        )
        assert interrupted == reference and all(interrupted)
        if mode == "asymspec":
            assert reopens(edge) == 0  # opened afresh, not re-opened mid-request


def test_target_only_cloud_killed_mid_stream(pair: tuple[Path, Path], logs: Path) -> None:
    """Phase: mid-stream, target-only mode: a live cloud goes on from the prompt plus the
    tokens already streamed."""
    with killable_cloud(pair, logs, "target-only") as (cloud, edge, restart):
        interrupted, reference = asyncio.run(
            streams_and_reference(
                edge, PROMPTS, 600, kill_then_restart(cloud, restart, mid_stream=True)
            )
        )
        assert interrupted == reference and all(interrupted)


def test_cloud_restarted_between_requests_and_a_request_sent_while_down(
    pair: tuple[Path, Path], logs: Path
) -> None:
    """Phase: between requests. A request sent while the cloud is down waits for it (within
    the deadline) instead of failing at once; the ones after it run as usual."""
    with killable_cloud(pair, logs) as (cloud, edge, restart):
        body = {**greedy(PROMPTS[0], 30), "stream": False}
        before = httpx.post(f"{edge.url}/v1/completions", json=body, timeout=60)
        assert before.status_code == 200
        cloud.kill()

        async def while_down() -> httpx.Response:
            async with httpx.AsyncClient(base_url=edge.url, timeout=120) as client:
                sent = asyncio.create_task(client.post("/v1/completions", json=body))
                await asyncio.sleep(1.5)
                assert not sent.done()  # waiting for the cloud, not failed
                restart()
                return await sent

        during = asyncio.run(while_down())
        after = httpx.post(f"{edge.url}/v1/completions", json=body, timeout=60)
        assert during.status_code == 200 and after.status_code == 200, during.text
        assert len({r.json()["choices"][0]["text"] for r in (before, during, after)}) == 1


def test_replica_killed_mid_stream_its_sessions_finish_on_the_other(
    pair: tuple[Path, Path], logs: Path
) -> None:
    ports = free_port(), free_port()
    clouds = [start_cloud(pair, port, logs / f"c{i}.log") for i, port in enumerate(ports)]
    for cloud in clouds:
        cloud.wait_healthy()
    edge_port = free_port()
    env = edge_env(pair[1], edge_port, ports[0], "asymspec", cloud_deadline_s="30")
    env["ASYMSPEC_EDGE_CLOUD_URL"] = ",".join(f"ws://127.0.0.1:{p}/v1/channel" for p in ports)
    try:
        with running("edge_gateway", edge_port, env, logs) as edge:
            wait_for_replicas(edge, 2)  # /health is 200 as soon as one is connected

            async def fault(firsts: list[asyncio.Event]) -> None:
                await asyncio.gather(*(first.wait() for first in firsts))  # mid-stream
                # Two of the four sessions are on each replica (least-loaded placement).
                assert cloud_sessions(ports[0]) == 2 and cloud_sessions(ports[1]) == 2
                clouds[0].kill()  # and it stays down

            interrupted, reference = asyncio.run(streams_and_reference(edge, PROMPTS, 300, fault))
            assert interrupted == reference and all(interrupted)
            assert reopens(edge) == 2  # the killed replica's two sessions, once each
            assert httpx.get(f"{edge.url}/health").status_code == 200  # one replica is enough
    finally:
        for cloud in clouds:
            cloud.stop()


def test_client_leaving_while_its_session_opens_frees_both_sides(
    cluster: tuple[int, Service, dict[str, str]],
) -> None:
    cloud_port, edge, _ = cluster

    async def leave_early() -> None:
        async with httpx.AsyncClient(base_url=edge.url, timeout=30) as client:
            for prompt in LONG_PROMPTS:
                sent = asyncio.create_task(client.post("/v1/completions", json=greedy(prompt, 500)))
                await asyncio.sleep(0.05)  # the session is opening (prefill)
                sent.cancel()  # the client hangs up
                await asyncio.gather(sent, return_exceptions=True)

    asyncio.run(leave_early())
    assert_nothing_left_open(cloud_port, edge)


def test_a_refused_secret_is_reported_and_fails_requests_fast(
    pair: tuple[Path, Path], logs: Path
) -> None:
    cloud_port, edge_port = free_port(), free_port()
    env = edge_env(pair[1], edge_port, cloud_port, "asymspec", cloud_deadline_s="30")
    env["ASYMSPEC_EDGE_SHARED_SECRET"] = "not-the-clouds-secret"
    with running("cloud_verifier", cloud_port, cloud_env(pair[0], cloud_port), logs):
        edge = Service("edge_gateway", edge_port, env, logs / "edge.log")
        try:
            deadline = time.monotonic() + 60
            while True:  # up, but not ready: the cloud said no
                try:
                    health = httpx.get(f"{edge.url}/health", timeout=2)
                    if "refused" in health.json().get("reason", ""):
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline, edge.logs()
                time.sleep(0.2)
            assert health.status_code == 503
            assert (
                "the cloud refused this edge: unknown edge or bad secret" in health.json()["reason"]
            )
            started = time.monotonic()
            response = httpx.post(
                f"{edge.url}/v1/completions", json={**greedy("x", 5), "stream": False}, timeout=30
            )
            assert response.status_code == 503 and "refused" in response.json()["error"]["message"]
            assert time.monotonic() - started < 2  # not the 30 s deadline
        finally:
            edge.stop()


def test_cloud_killed_amid_correction_rounds(pair: tuple[Path, Path], logs: Path) -> None:
    """Phase: correction rounds. Untruncated T = 0.7 with a 1-proposal ladder makes most
    rejections cost downlink round trips; the cloud is killed as soon as they are flowing
    (the exact instant cannot be pinned to an open round from outside, so a kill lands in
    one with high probability, not certainty). Sampled output cannot be compared with a
    rerun (the cloud's draws restart with the session), so every stream must finish whole."""
    ladder = {"num_proposals": "1", "proposal_rounds": "4"}
    with killable_cloud(pair, logs, **ladder) as (cloud, edge, restart):

        async def run() -> list[dict]:
            async with httpx.AsyncClient(base_url=edge.url, timeout=120) as client:
                bodies = [
                    {"model": "asymspec", "prompt": p, "max_tokens": 300, "temperature": 0.7,
                     "seed": i, "ignore_eos": True}
                    for i, p in enumerate(PROMPTS)
                ]  # fmt: skip
                sent = [asyncio.create_task(client.post("/v1/completions", json=b)) for b in bodies]
                rounds = edge_counter(edge, "asymspec_correction_rounds_total")
                while edge_counter(edge, "asymspec_correction_rounds_total") < rounds + 5:
                    await asyncio.sleep(0.01)
                await kill_then_restart(cloud, restart)([])
                return [r.json() for r in await asyncio.gather(*sent)]

        results = asyncio.run(run())
        assert all(r["usage"]["completion_tokens"] == 300 for r in results), results
        assert reopens(edge) >= 1
