"""The owner of a link's shaping: which profile is active and which backend applies it.

Backend choice ("auto"): the first time something must be shaped, netem is tried; if the
kernel answers that the qdisc kind is unknown, the shaper falls back to htb for good and
logs that delay, jitter and loss are not emulated. Netem is tried by applying the real
shape, not a probe, so a kernel with netem never sees an unshaped gap.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from asymspec.links import LinkProfile

from .runner import CommandRunner
from .tc import (
    ETHERNET_MTU_BYTES,
    Direction,
    EgressShape,
    clear_commands,
    egress_shape,
    htb_commands,
    htb_root_present,
    netem_commands,
    netem_missing,
    nothing_to_clear,
    offload_commands,
    show_root_command,
)

log = logging.getLogger(__name__)

BackendChoice = Literal["auto", "netem", "htb"]
Backend = Literal["netem", "htb", "none"]  # none: nothing is shaped


class ShapeError(RuntimeError):
    """A tc command failed for a reason other than a missing sch_netem."""


@dataclass(frozen=True, slots=True)
class Egress:
    """One direction of the link: the interface whose egress carries it."""

    direction: Direction
    iface: str
    runner: CommandRunner


@dataclass(frozen=True, slots=True)
class LinkState:
    profile: LinkProfile
    backend: Backend
    switches_total: int  # successful applies after the first
    egresses: tuple[tuple[Direction, str], ...]  # (direction, iface) this shaper owns

    @property
    def delay_emulated(self) -> bool:
        """Whether delay, jitter and loss are in effect (htb shapes the rate only)."""
        return self.backend == "netem"

    def as_dict(self) -> dict[str, Any]:
        p = self.profile
        return {
            "profile": p.name,
            "backend": self.backend,
            "delay_emulated": self.delay_emulated,
            # JSON has no infinity: an unshaped rate is null.
            "uplink_mbit_s": _finite_or_none(p.uplink_mbit_s),
            "downlink_mbit_s": _finite_or_none(p.downlink_mbit_s),
            "delay_ms": p.delay_ms,
            "jitter_ms": p.jitter_ms,
            "loss_pct": p.loss_pct,
            "switches_total": self.switches_total,
            "egresses": {direction: iface for direction, iface in self.egresses},
        }


class LinkShaper:
    """Applies profiles to its egresses; thread-safe (the control endpoint is threaded)."""

    def __init__(
        self,
        egresses: Sequence[Egress],
        backend: BackendChoice = "auto",
        mtu_bytes: int = ETHERNET_MTU_BYTES,
    ) -> None:
        if not egresses:
            raise ValueError("nothing to shape: give an uplink and/or a downlink interface")
        self._egresses = tuple(egresses)
        self._backend: BackendChoice = backend
        self._mtu_bytes = mtu_bytes
        self._lock = threading.Lock()
        self._state: LinkState | None = None
        self._offloads_done: set[int] = set()  # indices into _egresses

    @property
    def state(self) -> LinkState | None:
        return self._state

    def apply(self, profile: LinkProfile) -> LinkState:
        """Shape every egress to `profile`. On a ShapeError `state` stays the previous one,
        although egresses before the failing one may already carry the new shape."""
        with self._lock:
            shaped_any = False
            for index, egress in enumerate(self._egresses):
                if index not in self._offloads_done:
                    _disable_offloads(egress)
                    self._offloads_done.add(index)
                shape = egress_shape(profile, egress.direction, self._mtu_bytes)
                shaped_any |= self._shape(egress, shape)
            backend: Backend = "none"
            if shaped_any and self._backend != "auto":
                backend = self._backend
            switches = 0 if self._state is None else self._state.switches_total + 1
            self._state = LinkState(
                profile, backend, switches, tuple((e.direction, e.iface) for e in self._egresses)
            )
            log.info("link profile %s applied (backend %s)", profile.name, backend)
            return self._state

    def clear(self) -> None:
        """Remove the qdiscs from every egress (the kernel default comes back)."""
        with self._lock:
            for egress in self._egresses:
                self._clear(egress)
            self._state = None

    def _shape(self, egress: Egress, shape: EgressShape) -> bool:
        """Apply one direction; whether a qdisc now shapes it."""
        if not (shape.rate_limited or shape.impaired):
            self._clear(egress)
            return False
        if self._backend in ("auto", "netem"):
            (argv,) = netem_commands(egress.iface, shape)
            result = egress.runner.run(argv)
            if result.ok:
                self._backend = "netem"
                return True
            if not (self._backend == "auto" and netem_missing(result.stderr)):
                raise ShapeError(f"{' '.join(result.argv)}: {result.stderr}")
            self._backend = "htb"
            log.warning(
                "kernel has no sch_netem: falling back to htb rate shaping; "
                "delay, jitter and loss are NOT emulated"
            )
        if shape.impaired:
            log.warning(
                "%s: delay %g ms, jitter %g ms, loss %g%% NOT emulated (htb shapes rate only)",
                egress.direction,
                shape.delay_ms,
                shape.jitter_ms,
                shape.loss_pct,
            )
        if not shape.rate_limited:
            self._clear(egress)
            return False
        shown = egress.runner.run(show_root_command(egress.iface))
        root_present = shown.ok and htb_root_present(shown.stdout)
        for argv in htb_commands(egress.iface, shape, root_present, self._mtu_bytes):
            result = egress.runner.run(argv)
            if not result.ok:
                raise ShapeError(f"{' '.join(result.argv)}: {result.stderr}")
        return True

    def _clear(self, egress: Egress) -> None:
        for argv in clear_commands(egress.iface):
            result = egress.runner.run(argv)
            if not (result.ok or nothing_to_clear(result.stderr)):
                raise ShapeError(f"{' '.join(result.argv)}: {result.stderr}")


def _disable_offloads(egress: Egress) -> None:
    for argv in offload_commands(egress.iface):
        result = egress.runner.run(argv)
        if not result.ok:
            # Shaping still works with offloads on, only less smoothly: carry on.
            log.warning("could not turn offloads off (%s): %s", argv[0], result.stderr)


def _finite_or_none(value: float) -> float | None:
    return value if math.isfinite(value) else None
