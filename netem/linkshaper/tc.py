"""tc and ethtool command lines as data: pure functions, no root needed to test them.

One direction of the link is one interface's egress. `EgressShape` is what that egress must
emulate; `netem_commands` emulates all of it, `htb_commands` only the rate (the fallback for
kernels without sch_netem). Both use `replace`, so re-applying switches a live link without
an unshaped gap, and both are idempotent.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from asymspec.links import LinkProfile

Argv = list[str]
Direction = Literal["uplink", "downlink"]

ETHERNET_MTU_BYTES = 1500
# Floor of the queue limit: at zero delay the bandwidth-delay product is ~0 packets, but TCP
# still needs room for a burst or it collapses into loss; 100 full frames is ~24 ms at
# 50 Mbit/s and ~0.5 ms at 2500 Mbit/s.
MIN_QUEUE_PACKETS = 100
# netem's own default limit; used when the rate is unshaped (no product to size from).
UNSHAPED_QUEUE_PACKETS = 1000
# htb's token bucket: at least 1 ms of traffic, or ten frames at low rates, so the timer
# granularity does not cap the rate; the class quantum must sit within what htb accepts.
HTB_BURST_S = 0.001
HTB_MIN_BURST_FRAMES = 10
HTB_MAX_QUANTUM_BYTES = 200_000
HTB_HANDLE = "1:"
HTB_CLASS = "1:1"
HTB_LEAF_HANDLE = "10:"


@dataclass(frozen=True, slots=True)
class EgressShape:
    """What one direction's egress emulates. rate_mbit_s = math.inf: no rate limit."""

    rate_mbit_s: float
    delay_ms: float = 0.0  # one-way
    jitter_ms: float = 0.0
    loss_pct: float = 0.0
    queue_packets: int = MIN_QUEUE_PACKETS

    @property
    def rate_limited(self) -> bool:
        return math.isfinite(self.rate_mbit_s)

    @property
    def impaired(self) -> bool:
        """Whether there is delay, jitter or loss, which only netem can emulate."""
        return self.delay_ms > 0 or self.jitter_ms > 0 or self.loss_pct > 0


def egress_shape(
    profile: LinkProfile, direction: Direction, mtu_bytes: int = ETHERNET_MTU_BYTES
) -> EgressShape:
    """The shape of one direction, with the queue sized to its bandwidth-delay product."""
    if direction == "uplink":
        rate_mbit_s, bdp_bytes = profile.uplink_mbit_s, profile.uplink_bdp_bytes()
    else:
        rate_mbit_s, bdp_bytes = profile.downlink_mbit_s, profile.downlink_bdp_bytes()
    if math.isinf(bdp_bytes):
        queue_packets = UNSHAPED_QUEUE_PACKETS
    else:
        queue_packets = max(math.ceil(bdp_bytes / mtu_bytes), MIN_QUEUE_PACKETS)
    return EgressShape(
        rate_mbit_s=rate_mbit_s,
        delay_ms=profile.delay_ms,
        jitter_ms=profile.jitter_ms,
        loss_pct=profile.loss_pct,
        queue_packets=queue_packets,
    )


def netem_commands(iface: str, shape: EgressShape) -> list[Argv]:
    """One netem root qdisc with rate, delay (± jitter), loss and a packet limit."""
    if not (shape.rate_limited or shape.impaired):
        return clear_commands(iface)
    argv = ["tc", "qdisc", "replace", "dev", iface, "root", "netem"]
    if shape.rate_limited:
        argv += ["rate", _tc_rate(shape.rate_mbit_s)]
    if shape.delay_ms > 0 or shape.jitter_ms > 0:
        argv += ["delay", _tc_time(shape.delay_ms)]
        if shape.jitter_ms > 0:
            # netem reorders packets whose jittered send times cross; TCP copes (README).
            argv.append(_tc_time(shape.jitter_ms))
    if shape.loss_pct > 0:
        argv += ["loss", f"{shape.loss_pct:g}%"]
    argv += ["limit", str(shape.queue_packets)]
    return [argv]


def htb_commands(
    iface: str,
    shape: EgressShape,
    root_present: bool = False,
    mtu_bytes: int = ETHERNET_MTU_BYTES,
) -> list[Argv]:
    """Rate only: a root htb, one class with ceil = rate, a pfifo leaf sized like netem's limit.

    htb cannot `change` itself, so when our root is already there (`root_present`, from
    `htb_root_present`) only the class and the leaf are replaced: a live switch, no gap.

    The leaf is pfifo, not fq_codel, because kernels that lack sch_netem often lack
    fq_codel too (this one does); with one flow class the fairness would be moot anyway.
    """
    if not shape.rate_limited:
        return clear_commands(iface)
    rate = _tc_rate(shape.rate_mbit_s)
    rate_bytes_s = shape.rate_mbit_s * 1_000_000 / 8
    burst_bytes = max(math.ceil(rate_bytes_s * HTB_BURST_S), HTB_MIN_BURST_FRAMES * mtu_bytes)
    # htb's own quantum rule (rate / r2q, r2q = 10), clamped to where htb does not warn.
    quantum_bytes = min(max(mtu_bytes, math.ceil(rate_bytes_s / 10)), HTB_MAX_QUANTUM_BYTES)
    # Written as the shell line it is; interface names cannot contain whitespace.
    root = (
        []
        if root_present
        else [f"tc qdisc replace dev {iface} root handle {HTB_HANDLE} htb default 1".split()]
    )
    return [
        *root,
        f"tc class replace dev {iface} parent {HTB_HANDLE} classid {HTB_CLASS} htb rate {rate}"
        f" ceil {rate} burst {burst_bytes} cburst {burst_bytes} quantum {quantum_bytes}".split(),
        f"tc qdisc replace dev {iface} parent {HTB_CLASS} handle {HTB_LEAF_HANDLE}"
        f" pfifo limit {shape.queue_packets}".split(),
    ]


def show_root_command(iface: str) -> Argv:
    return ["tc", "qdisc", "show", "dev", iface, "root"]


def htb_root_present(show_root_output: str) -> bool:
    """Whether `tc qdisc show dev IF root` lists the htb root that `htb_commands` installs."""
    fields = show_root_output.split()
    return fields[:3] == ["qdisc", "htb", HTB_HANDLE]


def clear_commands(iface: str) -> list[Argv]:
    """Back to the kernel's default qdisc (fails harmlessly if nothing is installed)."""
    return [["tc", "qdisc", "del", "dev", iface, "root"]]


def offload_commands(iface: str) -> list[Argv]:
    """Segmentation offloads off: with them a qdisc sees 64 KiB super-packets, so the rate
    comes out lumpy and the packet limits mean nothing."""
    return [["ethtool", "-K", iface, "tso", "off", "gso", "off", "gro", "off"]]


def netem_missing(stderr: str) -> bool:
    """Whether tc failed because netem is unavailable (so fall back to htb): the kernel has
    no sch_netem, or this tc build has no netem parser."""
    text = stderr.lower()
    return "qdisc kind is unknown" in text or 'unknown qdisc "netem"' in text


def nothing_to_clear(stderr: str) -> bool:
    """Whether `tc qdisc del ... root` failed only because no qdisc of ours was installed."""
    text = stderr.lower()
    return "handle of zero" in text or "no such file or directory" in text


def _tc_rate(mbit_s: float) -> str:
    # kbit (10^3 bit/s, like tc's mbit is 10^6) keeps fractional Mbit/s exact enough and
    # avoids tc parsing a float in scientific notation.
    return f"{round(mbit_s * 1000)}kbit"


def _tc_time(ms: float) -> str:
    us = round(ms * 1000)
    return f"{us // 1000}ms" if us % 1000 == 0 else f"{us}us"
