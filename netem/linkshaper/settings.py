"""The sidecar's settings, read from the environment (no module globals: `from_env` is
called once by the entry point)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import cast, get_args

from .shaper import BackendChoice


@dataclass(frozen=True)
class Settings:
    link_profile: str = "weak"
    """LINK_PROFILE: weak | medium | strong | ideal (asymspec.links)."""
    uplink_iface: str = ""
    """UPLINK_IFACE: interface whose egress is edge -> cloud; empty = not shaped here."""
    downlink_iface: str = ""
    """DOWNLINK_IFACE: interface whose egress is cloud -> edge; empty = not shaped here."""
    uplink_peer: str = ""
    """UPLINK_PEER: instead of UPLINK_IFACE, the host (e.g. the cloud service) whose route
    picks the interface; container interface names are not stable across networks."""
    downlink_peer: str = ""
    """DOWNLINK_PEER: the same for the downlink (e.g. the edge service)."""
    delay_ms: float | None = None
    """LINK_DELAY_MS: one-way delay per direction; unset = the profile's (0)."""
    jitter_ms: float | None = None
    """LINK_JITTER_MS: delay jitter; unset = the profile's (0)."""
    loss_pct: float | None = None
    """LINK_LOSS_PCT: loss per direction in percent; unset = the profile's (0)."""
    backend: BackendChoice = "auto"
    """LINK_BACKEND: auto (netem, else htb) | netem | htb."""
    control_host: str = "0.0.0.0"
    """CONTROL_HOST: bind address of the control endpoint."""
    control_port: int = 9100
    """CONTROL_PORT: port of the control endpoint."""

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if env is None else env
        backend = env.get("LINK_BACKEND", "auto")
        if backend not in get_args(BackendChoice):
            raise ValueError(f"LINK_BACKEND must be one of {get_args(BackendChoice)}: {backend!r}")
        return cls(
            link_profile=env.get("LINK_PROFILE", cls.link_profile),
            uplink_iface=env.get("UPLINK_IFACE", ""),
            downlink_iface=env.get("DOWNLINK_IFACE", ""),
            uplink_peer=env.get("UPLINK_PEER", ""),
            downlink_peer=env.get("DOWNLINK_PEER", ""),
            delay_ms=_optional_float(env, "LINK_DELAY_MS"),
            jitter_ms=_optional_float(env, "LINK_JITTER_MS"),
            loss_pct=_optional_float(env, "LINK_LOSS_PCT"),
            backend=cast(BackendChoice, backend),
            control_host=env.get("CONTROL_HOST", cls.control_host),
            control_port=int(env.get("CONTROL_PORT", str(cls.control_port))),
        )


def _optional_float(env: Mapping[str, str], name: str) -> float | None:
    value = env.get(name, "").strip()
    return float(value) if value else None
