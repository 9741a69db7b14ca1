"""One benchmark cell's processes in the testbed: cloud verifier, edge gateway, load driver.

    cloud netns, core 1:  python -m cloud_verifier   0.0.0.0:8001 (reached over the veth)
    edge netns,  core 0:  python -m edge_gateway     127.0.0.1:8000, channel to the cloud
    edge netns,  any core: python -m loadtest.bench.driver  (talks to the edge on loopback)

Every process is fresh per cell, so no cache, queue or allocator state carries over from
the previous mode. Both services get one torch thread each: on a 2-core machine a second
thread per process only fights the other service for its core. The environment comes from
the process helpers the tests use too (``loadtest.processes``), overridden where the namespaces
differ from loopback (cloud address, bind address).
"""

from __future__ import annotations

import json
import queue
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from asymspec.modes import get_mode
from loadtest.bench.config import REPO_ROOT, ModelPair
from loadtest.processes import cloud_env, edge_env
from loadtest.testbed import Testbed

CLOUD_PORT, EDGE_PORT = 8001, 8000
CLOUD_CPU, EDGE_CPU = 1, 0


def service_torch_threads() -> dict[str, int]:
    """The torch threads each service of a cell runs with, as the tests' helpers set them."""
    cloud = cloud_env(Path(), CLOUD_PORT)["ASYMSPEC_CLOUD_THREADS"]
    edge = edge_env(Path(), EDGE_PORT, CLOUD_PORT, "asymspec")["ASYMSPEC_EDGE_THREADS"]
    return {"cloud": int(cloud), "edge": int(edge)}


_STOP_TIMEOUT_S = 15


class CellFailed(RuntimeError):
    """The cell produced no measurement; the message says why (with a log tail)."""


@dataclass(frozen=True)
class CellPlan:
    mode: str
    pair: ModelPair
    driver_spec: dict[str, Any]  # without the URLs, which the cell fills in
    log_dir: Path
    name: str  # file-name stem, e.g. "weak-asymspec"
    timeout_s: float
    # Both services' ASYMSPEC_*_DTYPE. auto: the benchmark measures the default engine (bf16
    # where the CPU has it); float32 is the exact mode, where greedy output equals the target's.
    dtype: str = "auto"
    goodput_pause: bool = False  # the edge's; off: every speculative mode speculates throughout


def service_envs(
    bed: Testbed,
    mode: str,
    pair: ModelPair,
    secret: str,
    dtype: str = "auto",
    goodput_pause: bool = False,
) -> tuple[dict[str, str], dict[str, str]]:
    """(cloud env, edge env) for one cell, from the tests' helpers plus the testbed's addresses."""
    cloud_ip = bed.layout.address("cloud")
    common = {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    cloud = {
        **common,
        **cloud_env(
            Path(pair.target), CLOUD_PORT, host="0.0.0.0", shared_secret=secret, dtype=dtype
        ),
    }
    extra: dict[str, str] = {
        "cloud_url": f"ws://{cloud_ip}:{CLOUD_PORT}/v1/channel",
        "shared_secret": secret,
        "allow_plaintext": "1",  # the testbed's link is namespaces on this host
        "dtype": dtype,
        "goodput_pause": "true" if goodput_pause else "false",
    }
    if pair.max_model_len is not None:
        extra["max_model_len"] = str(pair.max_model_len)
    edge = {**common, **edge_env(Path(pair.draft), EDGE_PORT, CLOUD_PORT, mode, **extra)}
    return cloud, edge


def _log_tail(path: Path, chars: int = 2500) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _read_lines(stream: IO[bytes], lines: queue.Queue[str | None]) -> None:
    for raw in stream:
        lines.put(raw.decode(errors="replace").strip())
    lines.put(None)


def run_cell(
    bed: Testbed, plan: CellPlan, on_event: Callable[[dict[str, Any]], None]
) -> dict[str, Any]:
    """Start the services and the driver, wait for the driver's result, stop everything."""
    plan.log_dir.mkdir(parents=True, exist_ok=True)
    needs_cloud = get_mode(plan.mode).needs_cloud
    cloud_env_, edge_env_ = service_envs(
        bed, plan.mode, plan.pair, secrets.token_urlsafe(16), plan.dtype, plan.goodput_pause
    )
    spec = {
        **plan.driver_spec,
        "edge_url": f"http://127.0.0.1:{EDGE_PORT}",
        "cloud_url": f"http://{bed.layout.address('cloud')}:{CLOUD_PORT}" if needs_cloud else None,
    }
    spec_path = plan.log_dir / f"{plan.name}-spec.json"
    out_path = plan.log_dir / f"{plan.name}-driver-out.json"
    spec_path.write_text(json.dumps(spec))
    out_path.unlink(missing_ok=True)
    logs = {side: plan.log_dir / f"{plan.name}-{side}.log" for side in ("cloud", "edge")}
    procs: dict[str, subprocess.Popen[bytes]] = {}
    handles = [path.open("wb") for path in logs.values()]
    try:
        if needs_cloud:
            procs["cloud"] = bed.spawn(
                "cloud", [sys.executable, "-m", "cloud_verifier"], cpu=CLOUD_CPU, env=cloud_env_,
                stdout=handles[0], stderr=subprocess.STDOUT, cwd=REPO_ROOT,
            )  # fmt: skip
        procs["edge"] = bed.spawn(
            "edge", [sys.executable, "-m", "edge_gateway"], cpu=EDGE_CPU, env=edge_env_,
            stdout=handles[1], stderr=subprocess.STDOUT, cwd=REPO_ROOT,
        )  # fmt: skip
        driver_argv = [sys.executable, "-m", "loadtest.bench.driver", str(spec_path), str(out_path)]
        procs["driver"] = bed.spawn(
            "edge", driver_argv, env={"PYTHONUNBUFFERED": "1"},
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=REPO_ROOT,
        )  # fmt: skip
        _follow_driver(procs, logs, plan.timeout_s, on_event)
        if not out_path.is_file():
            raise CellFailed(f"the driver wrote no result; edge log:\n{_log_tail(logs['edge'])}")
        result: dict[str, Any] = json.loads(out_path.read_text())
        return result
    finally:
        for name in ("driver", "edge", "cloud"):  # the client first, the cloud last
            if name in procs:
                _stop(procs[name])
        for handle in handles:
            handle.close()


def _follow_driver(
    procs: dict[str, subprocess.Popen[bytes]],
    logs: dict[str, Path],
    timeout_s: float,
    on_event: Callable[[dict[str, Any]], None],
) -> None:
    """Relay the driver's events until it exits; fail fast when a service dies first."""
    driver = procs["driver"]
    assert driver.stdout is not None
    lines: queue.Queue[str | None] = queue.Queue()
    threading.Thread(target=_read_lines, args=(driver.stdout, lines), daemon=True).start()
    deadline = time.monotonic() + timeout_s
    failure: str | None = None
    while True:
        try:
            line = lines.get(timeout=1.0)
        except queue.Empty:
            line = ""
        if line is None:
            break
        if line.startswith("{"):
            event = json.loads(line)
            if event.get("event") == "failed":
                failure = event["error"]
            on_event(event)
        for side in ("cloud", "edge"):
            proc = procs.get(side)
            if proc is not None and proc.poll() is not None:
                raise CellFailed(f"{side} exited ({proc.returncode}):\n{_log_tail(logs[side])}")
        if time.monotonic() > deadline:
            raise CellFailed(f"cell timed out after {timeout_s:.0f} s")
    driver.wait()
    if failure is not None or driver.returncode != 0:
        tail = _log_tail(logs["edge"])
        raise CellFailed(f"driver failed ({failure or driver.returncode}); edge log:\n{tail}")
