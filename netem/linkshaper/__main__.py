"""Command line of the link shaper.

    python -m netem.linkshaper serve [--dry-run]      # the sidecar: env-configured, see README
    python -m netem.linkshaper apply --profile weak --uplink-iface eth1 [--delay-ms 20] [--dry-run]
    python -m netem.linkshaper clear --uplink-iface eth1 [--dry-run]

`--dry-run` prints the tc/ethtool lines instead of running them (no root needed).
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading
from typing import get_args

from asymspec.links import get_profile

from .control import ControlServer
from .route import iface_toward
from .runner import CommandRunner, DryRunRunner, SubprocessRunner
from .settings import Settings
from .shaper import BackendChoice, Egress, LinkShaper

log = logging.getLogger("netem.linkshaper")


def serve(settings: Settings, runner: CommandRunner) -> None:
    uplink = settings.uplink_iface or _iface_for_peer(settings.uplink_peer, runner)
    downlink = settings.downlink_iface or _iface_for_peer(settings.downlink_peer, runner)
    shaper = LinkShaper(_egresses(uplink, downlink, runner), backend=settings.backend)
    profile = get_profile(
        settings.link_profile, settings.delay_ms, settings.jitter_ms, settings.loss_pct
    )
    shaper.apply(profile)
    server = ControlServer(shaper, settings.control_host, settings.control_port)
    # serve_forever must be stopped from another thread; SIGTERM is how compose stops us.
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown).start())
    log.info("control endpoint on %s:%d", settings.control_host, settings.control_port)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        # A stopped sidecar must not leave an invisible shaper behind in a shared namespace.
        shaper.clear()
        log.info("qdiscs removed; bye")


def _iface_for_peer(peer: str, runner: CommandRunner) -> str:
    return iface_toward(peer, runner) if peer else ""


def _egresses(uplink: str, downlink: str, runner: CommandRunner) -> list[Egress]:
    egresses = []
    if uplink:
        egresses.append(Egress("uplink", uplink, runner))
    if downlink:
        egresses.append(Egress("downlink", downlink, runner))
    return egresses


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m netem.linkshaper",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True)
    serve_cmd = commands.add_parser("serve", help="shape from the environment and serve control")
    apply_cmd = commands.add_parser("apply", help="shape once and exit")
    clear_cmd = commands.add_parser("clear", help="remove the qdiscs and exit")
    for cmd in (serve_cmd, apply_cmd, clear_cmd):
        cmd.add_argument("--dry-run", action="store_true", help="print commands, run nothing")
    for cmd in (apply_cmd, clear_cmd):
        cmd.add_argument("--uplink-iface", default="", help="egress carrying edge -> cloud")
        cmd.add_argument("--downlink-iface", default="", help="egress carrying cloud -> edge")
        cmd.add_argument("--netns", default=None, help="run inside this network namespace")
    apply_cmd.add_argument("--profile", required=True, help="weak | medium | strong | ideal")
    apply_cmd.add_argument("--delay-ms", type=float, default=None)
    apply_cmd.add_argument("--jitter-ms", type=float, default=None)
    apply_cmd.add_argument("--loss-pct", type=float, default=None)
    apply_cmd.add_argument("--backend", choices=get_args(BackendChoice), default="auto")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")

    netns = getattr(args, "netns", None)
    runner: CommandRunner = DryRunRunner(netns) if args.dry_run else SubprocessRunner(netns)
    if args.command == "serve":
        serve(Settings.from_env(), runner)
        return 0
    shaper = LinkShaper(
        _egresses(args.uplink_iface, args.downlink_iface, runner),
        backend=getattr(args, "backend", "auto"),
    )
    if args.command == "clear":
        shaper.clear()
        return 0
    state = shaper.apply(get_profile(args.profile, args.delay_ms, args.jitter_ms, args.loss_pct))
    print(json.dumps(state.as_dict()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
