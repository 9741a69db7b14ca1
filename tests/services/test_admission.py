"""Admission limits through a real edge process: API keys, body size, concurrency (429),
read timeouts on request heads and bodies (a slow client holds no slot)."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from loadtest.processes import Service, edge_env, free_port, running
from loadtest.tiny_models import save_tiny_pair

KEY = "sk-test-key"


def draft_only_edge(tmp_path_factory: pytest.TempPathFactory, **settings: str) -> Iterator[Service]:
    """A draft-only edge process (no cloud needed) with these admission settings."""
    _, draft = save_tiny_pair(tmp_path_factory.mktemp("pair"))
    port = free_port()
    env = edge_env(draft, port, free_port(), "draft-only", **settings)
    with running("edge_gateway", port, env, tmp_path_factory.mktemp("logs")) as service:
        yield service


@pytest.fixture(scope="module")
def edge(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    yield from draft_only_edge(
        tmp_path_factory,
        api_keys=f"other-key,{KEY}", max_concurrent_requests="2", max_body_bytes="4096",
    )  # fmt: skip


def post(edge: Service, body: dict, key: str | None = KEY, **kw: Any) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{edge.url}/v1/completions", json=body, headers=headers, timeout=60, **kw)


def test_api_key_required_and_checked(edge: Service) -> None:
    body = {"model": "asymspec", "prompt": "hi", "max_tokens": 2}
    assert post(edge, body, key=None).status_code == 401
    wrong = post(edge, body, key="sk-wrong")
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    assert post(edge, body).status_code == 200
    assert httpx.get(f"{edge.url}/health").status_code == 200  # probes need no key
    assert "asymspec_request_rejected_total" in httpx.get(f"{edge.url}/metrics").text


def test_oversized_body_is_413_with_an_openai_body(edge: Service) -> None:
    response = post(edge, {"model": "asymspec", "prompt": "x" * 10_000, "max_tokens": 2})
    assert response.status_code == 413 and "error" in response.json()


def test_over_the_concurrency_limit_gets_429_with_retry_after(edge: Service) -> None:
    body = {"model": "asymspec", "prompt": "count:", "max_tokens": 300, "ignore_eos": True}

    async def run() -> list[httpx.Response]:
        headers = {"Authorization": f"Bearer {KEY}"}
        async with httpx.AsyncClient(base_url=edge.url, headers=headers, timeout=60) as client:
            return await asyncio.gather(
                *(client.post("/v1/completions", json=body) for _ in range(8))
            )

    responses = asyncio.run(run())
    statuses = sorted(r.status_code for r in responses)
    assert statuses.count(200) >= 2 and 429 in statuses
    limited = next(r for r in responses if r.status_code == 429)
    assert limited.headers["retry-after"] == "1"
    assert limited.json()["error"]["type"] == "rate_limit_error"
    assert post(edge, {"model": "asymspec", "prompt": "again", "max_tokens": 2}).status_code == 200


@pytest.fixture(scope="module")
def strict_edge(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    """One request at a time, 1 s for a request's head and 1 s for its body."""
    yield from draft_only_edge(
        tmp_path_factory, max_concurrent_requests="1", body_timeout_s="1", header_timeout_s="1"
    )


def read_response(sock: socket.socket) -> str:
    """One whole HTTP response (head and its Content-Length of body) off a raw socket."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(
        next(
            v
            for k, _, v in (line.partition(b": ") for line in head.split(b"\r\n"))
            if k.lower() == b"content-length"
        )
    )
    while len(body) < length:
        body += sock.recv(65536)
    return (head + b"\r\n\r\n" + body).decode()


def test_a_half_sent_body_holds_no_slot_and_gets_408(strict_edge: Service) -> None:
    with socket.create_connection(("127.0.0.1", strict_edge.port), timeout=10) as slow:
        slow.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 1000\r\n\r\n{"model": '
        )  # and the rest never comes
        # The only slot is free for a complete request meanwhile.
        body = {"model": "asymspec", "prompt": "hi", "max_tokens": 2}
        ok = httpx.post(f"{strict_edge.url}/v1/completions", json=body, timeout=30)
        assert ok.status_code == 200
        answer = read_response(slow)
    assert answer.startswith("HTTP/1.1 408"), answer[:200]
    assert '"code": "body_timeout"' in answer


def test_a_trickled_request_head_is_closed(strict_edge: Service) -> None:
    with socket.create_connection(("127.0.0.1", strict_edge.port), timeout=10) as slow:
        slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # no end of headers
        started = time.monotonic()
        closed = slow.recv(65536)  # b"" once the server hangs up
        waited_s = time.monotonic() - started
    assert closed == b"" and waited_s < 5  # the 1 s head timeout, not forever
    assert httpx.get(f"{strict_edge.url}/health", timeout=5).status_code == 200
