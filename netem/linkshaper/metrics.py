"""Prometheus text exposition of a link's state (no client library: the image stays small).

Rates are the profile's, per direction of the whole link (in a two-sidecar deployment each
sidecar shapes one direction; `asymspec_link_shaped_iface_info` says which). Delay, jitter
and loss are what is *in effect*: 0 under the htb fallback, whatever the profile asks.
"""

from __future__ import annotations

import math

from .shaper import LinkState

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_BITS_PER_MBIT = 1_000_000


def render_metrics(state: LinkState | None) -> str:
    if state is None:
        return _gauge("asymspec_link_up", "Whether a profile is applied.", 0.0)
    p = state.profile
    emulated = state.delay_emulated
    info_labels = {
        "profile": p.name,
        "backend": state.backend,
        "delay_emulated": str(emulated).lower(),
    }
    parts = [
        _gauge("asymspec_link_up", "Whether a profile is applied.", 1.0),
        _header("asymspec_link_profile_info", "gauge", "Active link profile and shaping backend.")
        + _sample("asymspec_link_profile_info", 1.0, info_labels),
        _header("asymspec_link_shaped_iface_info", "gauge", "Egress interfaces shaped here.")
        + "".join(
            _sample("asymspec_link_shaped_iface_info", 1.0, {"direction": d, "iface": i})
            for d, i in state.egresses
        ),
        _gauge(
            "asymspec_link_uplink_rate_bits_per_second",
            "Profile rate edge -> cloud; +Inf = unshaped.",
            p.uplink_mbit_s * _BITS_PER_MBIT,
        ),
        _gauge(
            "asymspec_link_downlink_rate_bits_per_second",
            "Profile rate cloud -> edge; +Inf = unshaped.",
            p.downlink_mbit_s * _BITS_PER_MBIT,
        ),
        _gauge(
            "asymspec_link_delay_seconds",
            "One-way delay in effect per direction (0 when not emulated).",
            p.delay_ms / 1000 if emulated else 0.0,
        ),
        _gauge(
            "asymspec_link_jitter_seconds",
            "Delay jitter in effect per direction (0 when not emulated).",
            p.jitter_ms / 1000 if emulated else 0.0,
        ),
        _gauge(
            "asymspec_link_loss_ratio",
            "Packet loss probability in effect per direction (0 when not emulated).",
            p.loss_pct / 100 if emulated else 0.0,
        ),
        _header("asymspec_link_profile_switches_total", "counter", "Runtime profile switches.")
        + _sample("asymspec_link_profile_switches_total", float(state.switches_total), {}),
    ]
    return "".join(parts)


def _gauge(name: str, help_text: str, value: float) -> str:
    return _header(name, "gauge", help_text) + _sample(name, value, {})


def _header(name: str, kind: str, help_text: str) -> str:
    return f"# HELP {name} {help_text}\n# TYPE {name} {kind}\n"


def _sample(name: str, value: float, labels: dict[str, str]) -> str:
    label_text = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
    return f"{name}{{{label_text}}} {_number(value)}\n" if labels else f"{name} {_number(value)}\n"


def _number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
