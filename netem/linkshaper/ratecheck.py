"""Measure what a link really carries: a TCP sink and a TCP source (stdlib only), run as two
processes, each wherever its command prefix puts it (e.g. `ip netns exec cloud`).

The rate is goodput, counted by the sink from `warmup_s` after the first byte (slow start
excluded) to EOF (the sender's queued bytes drain at the shaped rate, so they count too).
Goodput is below the shaped rate by the headers: with a 1500-byte MTU and TCP timestamps a
1514-byte frame carries 1448 payload bytes, so the ceiling is 95.6 % of the tc rate.

    python -m netem.linkshaper.ratecheck sink --port 47000
    python -m netem.linkshaper.ratecheck source --host 10.77.0.2 --port 47000 --seconds 3
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

DEFAULT_PORT = 47000
CHUNK_BYTES = 256 * 1024
READY = "ready"
_MODULE = "netem.linkshaper.ratecheck"
# Frame overhead with a 1500-byte MTU: 14 Ethernet + 20 IP + 32 TCP (with timestamps).
PAYLOAD_FRACTION = 1448 / 1514


@dataclass(frozen=True, slots=True)
class RateMeasurement:
    payload_bytes: int
    seconds: float

    @property
    def mbit_s(self) -> float:
        """Goodput in Mbit/s (10^6 bit/s, tc's unit)."""
        return self.payload_bytes * 8 / self.seconds / 1e6


def run_sink(bind: str, port: int, warmup_s: float) -> RateMeasurement:
    """Accept one connection, read it to EOF, count the bytes after the warm-up."""
    with socket.create_server((bind, port), reuse_port=False) as server:
        print(READY, flush=True)
        conn, _ = server.accept()
        with conn:
            buffer = bytearray(CHUNK_BYTES)
            n = conn.recv_into(buffer)
            count_from = time.monotonic() + warmup_s
            counted, start = 0, None
            while n:
                now = time.monotonic()
                if now >= count_from:
                    if start is None:
                        start = now  # bytes of this read arrived during the warm-up: skip them
                    else:
                        counted += n
                n = conn.recv_into(buffer)
            end = time.monotonic()
    if start is None or end <= start:
        raise RuntimeError(f"transfer ended within the {warmup_s} s warm-up")
    return RateMeasurement(counted, end - start)


def run_source(host: str, port: int, seconds: float) -> None:
    """Send as fast as the link takes for `seconds`, then close."""
    chunk = os.urandom(CHUNK_BYTES)  # incompressible, in case anything on the path compresses
    with socket.create_connection((host, port), timeout=30) as conn:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            conn.sendall(chunk)
        conn.shutdown(socket.SHUT_WR)


def measure_rate(
    sink_prefix: Sequence[str],
    source_prefix: Sequence[str],
    host: str,
    port: int = DEFAULT_PORT,
    seconds: float = 3.0,
    warmup_s: float = 0.5,
    python: str = sys.executable,
) -> RateMeasurement:
    """Run a sink (listening on all addresses) and a source (connecting to `host`) as
    subprocesses, each after its prefix, and return the sink's measurement. `python` is the
    interpreter the prefixes run (inside a container: the image's, not this one)."""
    module = [python, "-m", _MODULE]
    # The subprocesses import this package from its folder, wherever the caller's cwd is.
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    sink_argv = [*sink_prefix, *module, "sink", "--port", str(port), "--warmup-s", str(warmup_s)]
    source_argv = [*source_prefix, *module, "source", "--host", host, "--port", str(port)]
    source_argv += ["--seconds", str(seconds)]
    timeout_s = seconds + 30
    with subprocess.Popen(
        sink_argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    ) as sink:
        try:
            assert sink.stdout is not None
            if sink.stdout.readline().strip() != READY:
                raise RuntimeError(f"rate sink did not start: {sink.communicate()[1].strip()}")
            subprocess.run(
                source_argv, check=True, timeout=timeout_s, env=env, capture_output=True, text=True
            )
            out, err = sink.communicate(timeout=timeout_s)
        finally:
            if sink.poll() is None:
                sink.kill()
    if sink.returncode != 0:
        raise RuntimeError(f"rate sink failed: {err.strip()}")
    result = json.loads(out)
    return RateMeasurement(int(result["payload_bytes"]), float(result["seconds"]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m netem.linkshaper.ratecheck")
    roles = parser.add_subparsers(dest="role", required=True)
    sink = roles.add_parser("sink", help="receive one transfer, print its rate as JSON")
    sink.add_argument("--bind", default="0.0.0.0")
    sink.add_argument("--port", type=int, default=DEFAULT_PORT)
    sink.add_argument("--warmup-s", type=float, default=0.5)
    source = roles.add_parser("source", help="send to a sink for --seconds")
    source.add_argument("--host", required=True)
    source.add_argument("--port", type=int, default=DEFAULT_PORT)
    source.add_argument("--seconds", type=float, default=3.0)
    args = parser.parse_args(argv)
    if args.role == "sink":
        m = run_sink(args.bind, args.port, args.warmup_s)
        rate = {"payload_bytes": m.payload_bytes, "seconds": m.seconds, "mbit_s": m.mbit_s}
        print(json.dumps(rate))
    else:
        run_source(args.host, args.port, args.seconds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
