"""Many edges, one cloud: every edge numbers its sessions from 1, and the cloud keys them
per connection, so concurrent requests through two edges never collide.

Real processes on loopback: one cloud verifier, two asymspec edges and a target-only edge
(the 1 x 1 reference), three concurrent greedy completions on each asymspec edge.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import ExitStack

import httpx
import pytest

from tests.services.processes import Service, cloud_env, edge_env, free_port, running
from tests.services.tiny_models import save_tiny_pair

PROMPTS = ("def add(a, b):", "The quick brown", "for i in range(10):")


@pytest.fixture(scope="module")
def services(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Service]]:
    target, draft = save_tiny_pair(tmp_path_factory.mktemp("pair"))
    logs = tmp_path_factory.mktemp("logs")
    with ExitStack() as stack:
        cloud_port = free_port()
        stack.enter_context(
            running("cloud_verifier", cloud_port, cloud_env(target, cloud_port), logs)
        )
        found = {}
        for name, mode in (("a", "asymspec"), ("b", "asymspec"), ("ref", "target-only")):
            port = free_port()
            env = edge_env(draft, port, cloud_port, mode, max_model_len="512")
            found[name] = stack.enter_context(running("edge_gateway", port, env, logs))
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
