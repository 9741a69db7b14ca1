"""Real service processes for end-to-end tests: `python -m cloud_verifier` / `edge_gateway`
under uvicorn on loopback, configured through the environment like a user would."""

from __future__ import annotations

import atexit
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Service:
    def __init__(
        self,
        module: str,
        port: int,
        env: dict[str, str],
        log_path: Path,
        ca_certs: Path | None = None,
    ) -> None:
        """``ca_certs``: the service serves https, with a certificate that CA signed."""
        self.module, self.port, self.log_path = module, port, log_path
        self.url = f"{'https' if ca_certs else 'http'}://127.0.0.1:{port}"
        self.verify: ssl.SSLContext | bool = (
            ssl.create_default_context(cafile=str(ca_certs)) if ca_certs else True
        )
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **env}
        self._log = log_path.open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module],
            env=full_env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self._stopping = False
        # A test that dies between start and stop must not leave a server behind.
        atexit.register(self._reap)

    def _reap(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()

    def wait_healthy(self, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.module} exited early:\n{self.logs()}")
            try:
                health = httpx.get(f"{self.url}/health", timeout=2, verify=self.verify)
                if health.status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"{self.module} not healthy in {timeout_s} s:\n{self.logs()}")

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def begin_stop(self) -> None:
        """Ask it to shut down (SIGINT, once: uvicorn takes a second one as a forced quit)."""
        if self.proc.poll() is None and not self._stopping:
            self.proc.send_signal(signal.SIGINT)
            self._stopping = True

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.begin_stop()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()

    def kill(self) -> None:
        """Die at once, as a crashed process would."""
        self.proc.kill()
        self.proc.wait()


SHARED_SECRET = "test-shared-secret"


def cloud_env(target: Path, port: int, **extra: str) -> dict[str, str]:
    return {
        "ASYMSPEC_CLOUD_SHARED_SECRET": SHARED_SECRET,
        "ASYMSPEC_CLOUD_TARGET_MODEL": str(target),
        "ASYMSPEC_CLOUD_PORT": str(port),
        "ASYMSPEC_CLOUD_THREADS": "1",
        "ASYMSPEC_CLOUD_DTYPE": "float32",  # the exact mode: greedy output equals the target's
        **{f"ASYMSPEC_CLOUD_{k.upper()}": v for k, v in extra.items()},
    }


def edge_env(draft: Path, port: int, cloud_port: int, mode: str, **extra: str) -> dict[str, str]:
    return {
        "ASYMSPEC_EDGE_SHARED_SECRET": SHARED_SECRET,
        "ASYMSPEC_MODE": mode,
        "ASYMSPEC_EDGE_DRAFT_MODEL": str(draft),
        "ASYMSPEC_EDGE_PORT": str(port),
        "ASYMSPEC_EDGE_CLOUD_URL": f"ws://127.0.0.1:{cloud_port}/v1/channel",
        "ASYMSPEC_EDGE_THREADS": "1",
        "ASYMSPEC_EDGE_DTYPE": "float32",
        # The tests check each mode's mechanism, so requests speculate throughout unless a
        # test turns the goodput pause on (the product's default)
        "ASYMSPEC_EDGE_GOODPUT_PAUSE": "false",
        **{f"ASYMSPEC_EDGE_{k.upper()}": v for k, v in extra.items()},
    }


@contextmanager
def running(module: str, port: int, env: dict[str, str], log_dir: Path) -> Iterator[Service]:
    """One service: ``running_all`` of it alone."""
    with running_all({module: (module, port, env)}, log_dir) as services:
        yield services[module]


@contextmanager
def running_all(
    specs: dict[str, tuple[str, int, dict[str, str]]], log_dir: Path
) -> Iterator[dict[str, Service]]:
    """Services by name from (module, port, env), started together and then each waited
    for, and stopped together: their start-ups (imports, model loads) and shutdowns overlap
    instead of running one after another (14 edges took ~85 s to start in turn here, ~55
    together)."""
    services: dict[str, Service] = {}
    try:
        for name, (module, port, env) in specs.items():
            services[name] = Service(module, port, env, log_dir / f"{module}-{port}.log")
        for service in services.values():
            service.wait_healthy()
        yield services
    finally:
        for service in services.values():
            service.begin_stop()
        for service in services.values():
            service.stop()


def wait_for_replicas(edge: Service, n: int, timeout_s: float = 30) -> None:
    """Until the edge has channels up to ``n`` cloud replicas (/health needs only one)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        metrics = httpx.get(f"{edge.url}/metrics").text
        line = next(x for x in metrics.splitlines() if x.startswith("asymspec_cloud_connected"))
        if float(line.split()[-1]) == n:
            return
        time.sleep(0.1)
    raise TimeoutError(f"the edge did not connect to {n} replicas")


def wait_for_reason(service: Service, text: str, timeout_s: float = 60) -> str:
    """Until the service's /health is 503 with a reason containing ``text``; the reason."""
    deadline = time.monotonic() + timeout_s
    reason = ""
    while time.monotonic() < deadline:
        if service.proc.poll() is not None:
            raise RuntimeError(f"{service.module} exited early:\n{service.logs()}")
        try:
            health = httpx.get(f"{service.url}/health", timeout=2, verify=service.verify)
            reason = str(health.json().get("reason", ""))
            if health.status_code == 503 and text in reason:
                return reason
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"no /health reason with {text!r} (last: {reason!r}):\n{service.logs()}")
