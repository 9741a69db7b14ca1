"""Many edges, one cloud, and verifier replicas: every edge numbers its sessions from 1, and
the cloud keys them per connection, so concurrent requests through two edges never collide;
an edge given two replica URLs spreads its sessions over both.

Real processes on loopback: two cloud verifiers; two asymspec edges on the first, two on
both replicas, and a target-only edge on the first (the 1 x 1 reference); three concurrent
greedy completions on each asymspec edge.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import ExitStack

import httpx
import pytest

from loadtest.processes import (
    Service,
    cloud_env,
    edge_env,
    free_port,
    running,
    wait_for_replicas,
)
from loadtest.tiny_models import save_tiny_pair

PROMPTS = ("def add(a, b):", "The quick brown", "for i in range(10):")


@pytest.fixture(scope="module")
def services(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Service]]:
    target, draft = save_tiny_pair(tmp_path_factory.mktemp("pair"))
    logs = tmp_path_factory.mktemp("logs")
    with ExitStack() as stack:
        found = {}
        cloud_ports = free_port(), free_port()
        for name, port in zip(("cloud1", "cloud2"), cloud_ports, strict=True):
            found[name] = stack.enter_context(
                running("cloud_verifier", port, cloud_env(target, port), logs)
            )
        both = ",".join(f"ws://127.0.0.1:{port}/v1/channel" for port in cloud_ports)
        for name, mode, urls in (
            ("a", "asymspec", None), ("b", "asymspec", None), ("ref", "target-only", None),
            ("r1", "asymspec", both), ("r2", "asymspec", both),
        ):  # fmt: skip
            port = free_port()
            env = edge_env(draft, port, cloud_ports[0], mode, max_model_len="512")
            if urls is not None:
                env["ASYMSPEC_EDGE_CLOUD_URL"] = urls
            found[name] = stack.enter_context(running("edge_gateway", port, env, logs))
        for name in ("r1", "r2"):
            wait_for_replicas(found[name], 2)
        yield found


async def complete_all(edge: Service, prompts: tuple[str, ...]) -> list[str]:
    async with httpx.AsyncClient(base_url=edge.url, timeout=60) as client:

        async def one(prompt: str) -> str:
            body = {
                "model": "asymspec", "prompt": prompt, "max_tokens": 24, "temperature": 0,
                "ignore_eos": True,
            }  # fmt: skip
            response = await client.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            return str(response.json()["choices"][0]["text"])

        return list(await asyncio.gather(*(one(p) for p in prompts)))


def test_two_edges_share_one_cloud(services: dict[str, Service]) -> None:
    async def run() -> tuple[list[str], list[str]]:
        a, b = await asyncio.gather(
            complete_all(services["a"], PROMPTS), complete_all(services["b"], PROMPTS)
        )
        return a, b

    expected = asyncio.run(complete_all(services["ref"], PROMPTS))
    through_a, through_b = asyncio.run(run())
    assert through_a == expected and through_b == expected


def verified_blocks(cloud: Service) -> float:
    metrics = httpx.get(f"{cloud.url}/metrics").text
    line = next(x for x in metrics.splitlines() if x.startswith("asymspec_verified_blocks_total"))
    return float(line.split()[-1])


def test_two_edges_share_two_replicas(services: dict[str, Service]) -> None:
    async def run() -> tuple[list[str], list[str]]:
        a, b = await asyncio.gather(
            complete_all(services["r1"], PROMPTS), complete_all(services["r2"], PROMPTS)
        )
        return a, b

    expected = asyncio.run(complete_all(services["ref"], PROMPTS))
    before = [verified_blocks(services[c]) for c in ("cloud1", "cloud2")]
    through_1, through_2 = asyncio.run(run())
    assert through_1 == expected and through_2 == expected
    after = [verified_blocks(services[c]) for c in ("cloud1", "cloud2")]
    # Least-loaded placement: three concurrent sessions per edge land on both replicas.
    assert all(a > b for a, b in zip(after, before, strict=True)), (before, after)


def test_a_full_cloud_is_a_429_with_retry_after(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The cloud refusing a session (OVERLOADED) is the client's cue to retry, not a 502."""
    target, draft = save_tiny_pair(tmp_path_factory.mktemp("pair-full"))
    logs = tmp_path_factory.mktemp("logs-full")
    cloud_port, edge_port = free_port(), free_port()
    with (
        running(
            "cloud_verifier",
            cloud_port,
            cloud_env(target, cloud_port, max_sessions_per_edge="1"),
            logs,
        ),
        running(
            "edge_gateway",
            edge_port,
            edge_env(draft, edge_port, cloud_port, "asymspec", max_model_len="512"),
            logs,
        ) as edge,
    ):

        async def both() -> list[httpx.Response]:
            body = {"model": "asymspec", "prompt": "The quick brown", "max_tokens": 200,
                    "temperature": 0, "ignore_eos": True}  # fmt: skip
            async with httpx.AsyncClient(base_url=edge.url, timeout=60) as client:
                return list(
                    await asyncio.gather(
                        *(client.post("/v1/completions", json=body) for _ in range(2))
                    )
                )

        responses = asyncio.run(both())
        assert sorted(r.status_code for r in responses) == [200, 429]
        refused = next(r for r in responses if r.status_code == 429)
        assert refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["type"] == "rate_limit_error"
