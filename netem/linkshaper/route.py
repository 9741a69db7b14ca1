"""Find the interface that carries traffic to a peer: in a container, `eth0`/`eth1` order
depends on how networks were attached, but the route to the cloud (or edge) does not."""

from __future__ import annotations

import re
import socket
import time

from .runner import CommandRunner

_DEV = re.compile(r"\bdev\s+(\S+)")


def route_device(route_get_output: str) -> str:
    """The `dev` of one line of `ip -o route get ADDRESS`."""
    match = _DEV.search(route_get_output)
    if match is None:
        raise ValueError(f"no 'dev' in route: {route_get_output.strip()!r}")
    return match.group(1)


def iface_toward(peer: str, runner: CommandRunner, wait_s: float = 60.0) -> str:
    """The egress interface toward `peer` (a host name or address). Waits up to `wait_s`
    for the name to resolve, because the peer's container may start after this one."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            address = socket.getaddrinfo(peer, None, socket.AF_INET)[0][4][0]
            break
        except socket.gaierror:
            if time.monotonic() > deadline:
                raise
            time.sleep(1.0)
    result = runner.run(["ip", "-o", "route", "get", str(address)])
    if not result.ok:
        raise RuntimeError(f"ip route get {address}: {result.stderr}")
    return route_device(result.stdout)
