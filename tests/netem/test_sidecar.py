"""The sidecar process as its image runs it (`python -m netem.linkshaper serve`, configured
from the environment): dry-run on loopback (no root), and for real in a namespace, where it
finds its interface from the route to its peer and removes its qdiscs on SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from loadtest.testbed import Testbed

REPO_ROOT = Path(__file__).resolve().parents[2]
_GET = (
    "import sys, urllib.request as u\n"
    "r = u.urlopen(u.Request(sys.argv[1], method=sys.argv[2]), timeout=5)\n"
    "print(r.read().decode())"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http(prefix: list[str], method: str, url: str, wait_s: float = 10.0) -> str:
    """One request from inside `prefix`'s namespace, retried while the sidecar starts."""
    deadline = time.monotonic() + wait_s
    while True:
        done = subprocess.run(
            [*prefix, sys.executable, "-c", _GET, url, method], capture_output=True, text=True
        )
        if done.returncode == 0 or time.monotonic() > deadline:
            assert done.returncode == 0, done.stderr
            return done.stdout
        time.sleep(0.2)


def sidecar_env(**settings: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO_ROOT), "CONTROL_HOST": "127.0.0.1", **settings}


def test_dry_run_sidecar() -> None:
    port = free_port()
    env = sidecar_env(LINK_PROFILE="strong", UPLINK_IFACE="eth1", CONTROL_PORT=str(port))
    argv = [sys.executable, "-m", "netem.linkshaper", "serve", "--dry-run"]
    with subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, text=True) as proc:
        try:
            state = json.loads(http([], "GET", f"http://127.0.0.1:{port}/profile"))
            assert (state["profile"], state["uplink_mbit_s"]) == ("strong", 250)
        finally:
            proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=10)
    assert "+ tc qdisc replace dev eth1 root netem rate 250000kbit limit 100" in out
    assert out.rstrip().endswith("+ tc qdisc del dev eth1 root")  # cleared on SIGTERM


def test_sidecar_in_a_namespace(bare_testbed: Testbed) -> None:
    layout = bare_testbed.layout
    show = bare_testbed.command("edge", ["tc", "qdisc", "show", "dev", layout.iface])
    env = sidecar_env(LINK_PROFILE="weak", UPLINK_PEER=layout.cloud_address, CONTROL_PORT="9100")
    argv = [sys.executable, "-m", "netem.linkshaper", "serve"]
    proc = bare_testbed.spawn("edge", argv, env=env, stderr=subprocess.DEVNULL)
    in_edge = bare_testbed.command("edge", [])
    state = json.loads(http(in_edge, "PUT", "http://127.0.0.1:9100/profile/medium"))
    assert state["egresses"] == {"uplink": layout.iface} and state["switches_total"] == 1
    backend = state["backend"]
    assert f"qdisc {backend}" in subprocess.run(show, capture_output=True, text=True).stdout
    proc.send_signal(signal.SIGTERM)  # `ip netns exec` execs, so this reaches the sidecar
    assert proc.wait(timeout=10) == 0
    assert f"qdisc {backend}" not in subprocess.run(show, capture_output=True, text=True).stdout
