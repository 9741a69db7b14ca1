"""A server under test as a process group of its own: started, waited for until healthy,
and stopped as a whole (``scripts/run_local.sh`` starts two services; a signal to the group
reaches both)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

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
