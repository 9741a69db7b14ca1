"""Local testbed: an edge and a cloud network namespace joined by a veth pair, shaped to a
link profile by the sidecar's own code (netem.linkshaper, installed with the project).
Root only; no Docker.

    edge netns  10.77.0.1/30  wan0 ==veth== wan0  10.77.0.2/30  cloud netns
                uplink shaped on edge egress      downlink shaped on cloud egress

Names carry a random run id, so parallel runs do not clash (the addresses live only inside
each run's namespaces).

    python -m loadtest.testbed check --profile weak --profile medium --profile strong
    python -m loadtest.testbed up --profile weak           # prints the run id and names
    python -m loadtest.testbed switch --run-id ID --profile medium
    python -m loadtest.testbed down --run-id ID

In code, `with open_testbed("weak") as tb:` then `tb.spawn("cloud", [...], cpu=1)`,
`tb.switch(get_profile("medium"))`, `tb.measure("uplink")`; teardown also runs on error.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import secrets
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

from asymspec.links import LinkProfile, get_profile
from netem.linkshaper.ratecheck import (
    DEFAULT_PORT,
    PAYLOAD_FRACTION,
    RateMeasurement,
    measure_rate,
)
from netem.linkshaper.runner import SubprocessRunner, netns_prefix
from netem.linkshaper.shaper import Egress, LinkShaper, LinkState
from netem.linkshaper.tc import Argv, Direction

Side = Literal["edge", "cloud"]
RATE_TOLERANCE = 0.10
# Sender and receiver of a rate check on different cores, like the two services.
_CPU = {"edge": 0, "cloud": 1}


@dataclass(frozen=True, slots=True)
class TestbedLayout:
    """Names and addresses of one testbed run."""

    __test__ = False  # not a pytest test class, despite the name

    run_id: str
    prefix: str = "asymspec"
    iface: str = "wan0"  # the same name on both sides: each lives in its own namespace
    edge_address: str = "10.77.0.1"
    cloud_address: str = "10.77.0.2"
    prefix_len: int = 30

    @classmethod
    def new(cls, prefix: str = "asymspec") -> TestbedLayout:
        return cls(run_id=secrets.token_hex(3), prefix=prefix)

    def netns(self, side: Side) -> str:
        return f"{self.prefix}-{side}-{self.run_id}"

    def address(self, side: Side) -> str:
        return self.edge_address if side == "edge" else self.cloud_address


def create_commands(layout: TestbedLayout) -> list[Argv]:
    """Namespaces, the veth pair created directly inside them (never in the host's), up."""
    edge, cloud, iface = layout.netns("edge"), layout.netns("cloud"), layout.iface
    commands: list[Argv] = [
        ["ip", "netns", "add", edge],
        ["ip", "netns", "add", cloud],
        f"ip link add {iface} netns {edge} type veth peer name {iface} netns {cloud}".split(),
    ]
    for side in ("edge", "cloud"):
        ns = layout.netns(side)
        cidr = f"{layout.address(side)}/{layout.prefix_len}"
        commands += [
            ["ip", "-n", ns, "addr", "add", cidr, "dev", iface],
            ["ip", "-n", ns, "link", "set", "lo", "up"],
            ["ip", "-n", ns, "link", "set", iface, "up"],
        ]
    return commands


def destroy_commands(layout: TestbedLayout) -> list[Argv]:
    """Deleting a namespace deletes its end of the veth, and with it the pair."""
    return [["ip", "netns", "del", layout.netns(side)] for side in ("edge", "cloud")]


def netns_command(netns: str, argv: Sequence[str], cpu: int | None = None) -> list[str]:
    """`ip netns exec NETNS [taskset -c CPU] ARGV...`."""
    pin = ["taskset", "-c", str(cpu)] if cpu is not None else []
    return [*netns_prefix(netns), *pin, *argv]


@dataclass(frozen=True, slots=True)
class RateCheck:
    direction: Direction
    profile_mbit_s: float
    measured: RateMeasurement

    @property
    def ratio(self) -> float:
        return self.measured.mbit_s / self.profile_mbit_s

    @property
    def ok(self) -> bool:
        return math.isinf(self.profile_mbit_s) or abs(self.ratio - 1) <= RATE_TOLERANCE

    def as_dict(self) -> dict[str, Any]:
        return {
            "direction": self.direction,
            "profile_mbit_s": None if math.isinf(self.profile_mbit_s) else self.profile_mbit_s,
            "measured_mbit_s": round(self.measured.mbit_s, 1),  # TCP goodput
            # The rate tc sees, headers included: shaping itself is exact to ~0.5 %.
            "frame_mbit_s": round(self.measured.mbit_s / PAYLOAD_FRACTION, 1),
            "ratio": None if math.isinf(self.profile_mbit_s) else round(self.ratio, 3),
            "ok": self.ok,
        }


class Testbed:
    """One run's namespaces, its shaper and the processes spawned into it."""

    __test__ = False

    def __init__(self, layout: TestbedLayout) -> None:
        self.layout = layout
        self._shaper = LinkShaper(
            [
                Egress("uplink", layout.iface, SubprocessRunner(layout.netns("edge"))),
                Egress("downlink", layout.iface, SubprocessRunner(layout.netns("cloud"))),
            ]
        )
        self._processes: list[subprocess.Popen[bytes]] = []

    @property
    def state(self) -> LinkState | None:
        return self._shaper.state

    def create(self) -> None:
        """Make the namespaces and the pair; on failure undo only what this call made, so a
        name clash never deletes another run's namespace."""
        added: list[str] = []
        try:
            for argv in create_commands(self.layout):
                subprocess.run(argv, check=True, capture_output=True, text=True)
                if argv[:3] == ["ip", "netns", "add"]:
                    added.append(argv[3])
        except subprocess.CalledProcessError as exc:
            for netns in added:
                subprocess.run(["ip", "netns", "del", netns], capture_output=True, check=False)
            raise RuntimeError(f"{' '.join(exc.cmd)}: {exc.stderr.strip()}") from exc

    def switch(self, profile: LinkProfile) -> LinkState:
        """Shape both directions to `profile` (also the first shaping after `create`)."""
        return self._shaper.apply(profile)

    def destroy(self) -> None:
        """Stop what `spawn` started, then delete both namespaces; tolerates half-made runs."""
        for proc in self._processes:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        self._processes.clear()
        for argv in destroy_commands(self.layout):
            subprocess.run(argv, capture_output=True, check=False)

    def command(self, side: Side, argv: Sequence[str], cpu: int | None = None) -> list[str]:
        return netns_command(self.layout.netns(side), argv, cpu)

    def spawn(
        self,
        side: Side,
        argv: Sequence[str],
        cpu: int | None = None,
        env: Mapping[str, str] | None = None,
        **popen_kwargs: Any,
    ) -> subprocess.Popen[bytes]:
        """Start `argv` inside a side's namespace, pinned to `cpu`; stopped by `destroy`.
        `env` is added to this process's environment."""
        proc = subprocess.Popen(
            self.command(side, argv, cpu), env={**os.environ, **(env or {})}, **popen_kwargs
        )
        self._processes.append(proc)
        return proc

    def measure(
        self, direction: Direction, seconds: float = 3.0, port: int = DEFAULT_PORT
    ) -> RateMeasurement:
        """Goodput of one TCP transfer in `direction` through the shaped veth."""
        sender: Side = "edge" if direction == "uplink" else "cloud"
        receiver: Side = "cloud" if direction == "uplink" else "edge"
        return measure_rate(
            sink_prefix=self.command(receiver, [], _CPU[receiver]),
            source_prefix=self.command(sender, [], _CPU[sender]),
            host=self.layout.address(receiver),
            port=port,
            seconds=seconds,
        )

    def check(self, seconds: float = 3.0) -> list[RateCheck]:
        """Measure both directions against the active profile's rates."""
        if self.state is None:
            raise RuntimeError("no profile applied: call switch() first")
        profile = self.state.profile
        return [
            RateCheck("uplink", profile.uplink_mbit_s, self.measure("uplink", seconds)),
            RateCheck("downlink", profile.downlink_mbit_s, self.measure("downlink", seconds)),
        ]


@contextmanager
def open_testbed(
    profile: str | LinkProfile = "weak", layout: TestbedLayout | None = None
) -> Iterator[Testbed]:
    """A created and shaped testbed, destroyed on exit (also when the body raises)."""
    bed = Testbed(layout or TestbedLayout.new())
    bed.create()
    try:
        bed.switch(get_profile(profile) if isinstance(profile, str) else profile)
        yield bed
    finally:
        bed.destroy()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.testbed",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True)
    up = commands.add_parser("up", help="create and shape; leaves it running")
    switch = commands.add_parser("switch", help="re-shape a running testbed")
    down = commands.add_parser("down", help="tear a testbed down")
    check = commands.add_parser("check", help="create, measure each profile, tear down")
    for cmd in (up, switch, down, check):
        cmd.add_argument("--prefix", default="asymspec", help="namespace name prefix")
    for cmd in (switch, down):
        cmd.add_argument("--run-id", required=True, help="printed by `up`")
    for cmd in (up, switch):
        cmd.add_argument("--profile", default="weak", help="weak | medium | strong | ideal")
        cmd.add_argument("--delay-ms", type=float, default=None)
        cmd.add_argument("--jitter-ms", type=float, default=None)
        cmd.add_argument("--loss-pct", type=float, default=None)
    check.add_argument("--profile", action="append", help="repeatable; default: weak")
    check.add_argument("--seconds", type=float, default=3.0, help="per direction")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")

    if args.command == "check":
        return _check(args.profile or ["weak"], args.seconds, args.prefix)
    layout = (
        TestbedLayout.new(args.prefix)
        if args.command == "up"
        else TestbedLayout(run_id=args.run_id, prefix=args.prefix)
    )
    bed = Testbed(layout)
    if args.command == "down":
        bed.destroy()
        return 0
    if args.command == "up":
        bed.create()
    try:
        profile = get_profile(args.profile, args.delay_ms, args.jitter_ms, args.loss_pct)
        state = bed.switch(profile)
    except Exception:
        if args.command == "up":
            bed.destroy()
        raise
    names = {"run_id": layout.run_id, "edge_netns": layout.netns("edge")}
    print(json.dumps({**names, "cloud_netns": layout.netns("cloud"), **state.as_dict()}))
    return 0


def _check(profiles: Sequence[str], seconds: float, prefix: str) -> int:
    all_ok = True
    with open_testbed(profiles[0], TestbedLayout.new(prefix)) as bed:
        for index, name in enumerate(profiles):
            state = bed.state if index == 0 else bed.switch(get_profile(name))
            assert state is not None
            for result in bed.check(seconds):
                row = {"profile": name, "backend": state.backend, **result.as_dict()}
                print(json.dumps(row), flush=True)
                all_ok &= result.ok
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
