"""A server under test as a process group of its own: started, waited for until healthy,
and stopped as a whole (``scripts/run_local.sh`` starts two services; a signal to the group
reaches both); and the streaming chat client the benchmarks measure it with."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]


def port_is_free(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) != 0


class ServerProcess:
    """One server under test in its own process group, stopped as a whole."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], port: int, log: Path):
        if not port_is_free(port):  # else another process would answer for this one
            raise RuntimeError(f"port {port} is taken: stop what listens there first")
        self.name, self.port = name, port
        self.url = f"http://127.0.0.1:{port}"
        self.log = log.open("w")
        self.proc = subprocess.Popen(
            argv,
            cwd=REPO,
            env={**os.environ, **env},
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait_ready(self, timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{self.name} did not become healthy")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


@dataclass(frozen=True)
class StreamedChat:
    content: str
    tokens: int  # completion tokens as the usage chunk counts them, else content chunks
    ttft_s: float
    e2e_s: float


async def stream_chat(client: httpx.AsyncClient, body: dict[str, Any]) -> StreamedChat:
    """One streamed chat completion (``body`` without ``stream``), timed as a user sees it."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    first: float | None = None
    content, tokens, pieces = "", 0, 0
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if "error" in chunk:
                raise RuntimeError(chunk["error"])
            for choice in chunk.get("choices", []):
                piece = choice.get("delta", {}).get("content") or ""
                if piece:
                    first = first or time.perf_counter()
                    content += piece
                    pieces += 1
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    done = time.perf_counter()
    return StreamedChat(content, tokens or pieces, (first or done) - started, done - started)
