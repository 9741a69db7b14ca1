"""Real processes for the observability tests, beside the services of loadtest/processes.py:
a Prometheus scraping loopback, dry-run netem sidecars (their control endpoint and metrics,
no tc), and headless Locust runs of loadtest/locustfile.py."""

from __future__ import annotations

import csv
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS_YML = REPO_ROOT / "observability" / "prometheus" / "prometheus.yml"
LOCUSTFILE = REPO_ROOT / "loadtest" / "locustfile.py"
ENSURE_HINT = "install it as root (scripts/ensure_prometheus.sh) or set PROMETHEUS_BIN"


def prometheus_binary() -> str:
    """The prometheus executable: $PROMETHEUS_BIN, else the one on PATH."""
    found = os.environ.get("PROMETHEUS_BIN") or shutil.which("prometheus")
    if not found:
        raise FileNotFoundError(f"no prometheus binary: {ENSURE_HINT}")
    return found


def wait_http_ok(url: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited early:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} not ready in {timeout_s} s:\n{log.read_text()[-3000:]}")


@contextmanager
def background(
    argv: list[str], ready_url: str, log: Path, env: dict[str, str] | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    """A process that serves HTTP, up until ``ready_url`` answers 200, stopped on exit."""
    with log.open("ab") as out:
        proc = subprocess.Popen(argv, env=env, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT)
        try:
            wait_http_ok(ready_url, proc, log, timeout_s=60)
            yield proc
        finally:
            proc.terminate()  # SIGTERM: both Prometheus and the sidecar shut down cleanly
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@contextmanager
def dry_run_sidecar(direction: str, port: int, log_dir: Path) -> Iterator[str]:
    """`python -m netem.linkshaper serve --dry-run` shaping one direction of a made-up
    interface: the real control endpoint and /metrics, with tc commands only printed."""
    env = {
        **os.environ,
        "LINK_PROFILE": "weak",
        f"{direction.upper()}_IFACE": "eth-test",
        "CONTROL_HOST": "127.0.0.1",
        "CONTROL_PORT": str(port),
    }
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "netem.linkshaper", "serve", "--dry-run"]
    with background(argv, f"{url}/health", log_dir / f"netem-{direction}.log", env):
        yield url


def loopback_config(targets: dict[str, str], scrape_interval: str = "1s") -> dict[str, object]:
    """The committed prometheus.yml with each job's target moved to loopback, over http (same
    job names, so dashboards that filter on a job read the same here as in compose)."""
    config = yaml.safe_load(PROMETHEUS_YML.read_text())
    config["global"] = {
        **config.get("global", {}),
        "scrape_interval": scrape_interval,
        "evaluation_interval": scrape_interval,
    }
    for job in config["scrape_configs"]:
        job["static_configs"] = [{"targets": [targets[job["job_name"]]]}]
        job.pop("scheme", None)  # the services here serve plain http on loopback
        job.pop("tls_config", None)
    return config


@contextmanager
def prometheus(config: dict[str, object], port: int, work_dir: Path) -> Iterator[str]:
    config_path = work_dir / "prometheus.yml"
    config_path.write_text(yaml.safe_dump(config))
    argv = [
        prometheus_binary(),
        f"--config.file={config_path}",
        f"--storage.tsdb.path={work_dir / 'data'}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--log.level=warn",
    ]
    url = f"http://127.0.0.1:{port}"
    with background(argv, f"{url}/-/ready", work_dir / "prometheus.log"):
        yield url


def wait_targets_up(url: str, jobs: set[str], timeout_s: float = 30.0) -> None:
    """Until every job has been scraped successfully at least once."""
    deadline = time.monotonic() + timeout_s
    health: dict[str, str] = {}
    while time.monotonic() < deadline:
        active = httpx.get(f"{url}/api/v1/targets", timeout=5).json()["data"]["activeTargets"]
        health = {t["labels"]["job"]: t["health"] for t in active}
        if set(health) == jobs and all(h == "up" for h in health.values()):
            return
        time.sleep(0.5)
    raise TimeoutError(f"targets not all up in {timeout_s} s: {health}")


@dataclass(frozen=True)
class LocustRun:
    returncode: int
    output: str
    stats: list[dict[str, str]]  # rows of <prefix>_stats.csv


def run_locust(
    host: str, out_prefix: Path, run_time: str, users: int, env: dict[str, str]
) -> LocustRun:
    """A headless Locust run of the committed locustfile, as a real subprocess."""
    locust = Path(sys.executable).parent / "locust"
    argv = [
        str(locust),
        *("-f", str(LOCUSTFILE), "--headless", "--only-summary"),
        *("-u", str(users), "-r", str(users), "-t", run_time),
        # Let in-flight requests finish at the end, so none is cut off and counted as aborted.
        *("--stop-timeout", "30"),
        *("--csv", str(out_prefix), "--html", f"{out_prefix}.html", "--host", host),
    ]
    done = subprocess.run(
        argv, env={**os.environ, **env}, cwd=REPO_ROOT, capture_output=True, text=True
    )
    stats_csv = Path(f"{out_prefix}_stats.csv")
    stats = list(csv.DictReader(stats_csv.open())) if stats_csv.is_file() else []
    return LocustRun(done.returncode, done.stdout + done.stderr, stats)
