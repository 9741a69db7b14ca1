"""Link profiles between the edge and the cloud, as data (paper §V-A).

Rates are in Mbit/s with 1 Mbit = 10^6 bit, the same unit as tc's `mbit`. The paper gives
only rates; delay, jitter and loss are optional per run. `delay_ms` is the one-way delay
added on each direction's egress, so the round trip adds 2 × delay_ms.

The `ideal` profile is unshaped: its rates are `math.inf` (not None), so the arithmetic
below needs no special case (transfer time 0) and `shaped` tells shapers to leave it alone.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

_BITS_PER_BYTE = 8
_BITS_PER_MBIT = 1_000_000


@dataclass(frozen=True, slots=True)
class LinkProfile:
    name: str
    uplink_mbit_s: float  # edge -> cloud; math.inf = unshaped
    downlink_mbit_s: float  # cloud -> edge; math.inf = unshaped
    delay_ms: float = 0.0  # one-way, per direction
    jitter_ms: float = 0.0
    loss_pct: float = 0.0  # per direction, 0..100

    def __post_init__(self) -> None:
        if not (self.uplink_mbit_s > 0 and self.downlink_mbit_s > 0):
            raise ValueError(f"{self.name}: link rates must be > 0 Mbit/s")
        if not (self.delay_ms >= 0 and self.jitter_ms >= 0):
            raise ValueError(f"{self.name}: delay_ms and jitter_ms must be >= 0")
        if not 0 <= self.loss_pct <= 100:
            raise ValueError(f"{self.name}: loss_pct must be in 0..100, got {self.loss_pct}")

    @property
    def shaped(self) -> bool:
        """Whether anything needs emulating (a rate limit, delay, jitter or loss)."""
        rates_limited = math.isfinite(self.uplink_mbit_s) or math.isfinite(self.downlink_mbit_s)
        return rates_limited or self.delay_ms > 0 or self.jitter_ms > 0 or self.loss_pct > 0

    def uplink_seconds(self, n_bytes: int) -> float:
        """Serialization time of n_bytes edge -> cloud; excludes delay_ms."""
        return _transfer_seconds(n_bytes, self.uplink_mbit_s)

    def downlink_seconds(self, n_bytes: int) -> float:
        """Serialization time of n_bytes cloud -> edge; excludes delay_ms."""
        return _transfer_seconds(n_bytes, self.downlink_mbit_s)

    def uplink_bdp_bytes(self) -> float:
        """Bytes in flight edge -> cloud over a worst-case round trip; see `_bdp_bytes`."""
        return self._bdp_bytes(self.uplink_mbit_s)

    def downlink_bdp_bytes(self) -> float:
        """Bytes in flight cloud -> edge over a worst-case round trip; see `_bdp_bytes`."""
        return self._bdp_bytes(self.downlink_mbit_s)

    def _bdp_bytes(self, mbit_s: float) -> float:
        # rate × RTT with RTT = 2 × (delay + jitter): the worst case, because a netem queue
        # whose `limit` is below the bytes it must hold while delaying them drops packets
        # that the profile never asked to lose. Divide by the MTU for a packet `limit`.
        # Unshaped rate: no queue to size (math.inf), even at zero delay (inf × 0 is nan).
        if math.isinf(mbit_s):
            return math.inf
        rtt_s = 2 * (self.delay_ms + self.jitter_ms) / 1000
        return mbit_s * _BITS_PER_MBIT / _BITS_PER_BYTE * rtt_s


def _transfer_seconds(n_bytes: int, mbit_s: float) -> float:
    if n_bytes < 0:
        raise ValueError(f"n_bytes must be >= 0, got {n_bytes}")
    return n_bytes * _BITS_PER_BYTE / (mbit_s * _BITS_PER_MBIT)


PROFILES: Mapping[str, LinkProfile] = MappingProxyType(
    {
        "weak": LinkProfile("weak", uplink_mbit_s=50, downlink_mbit_s=150),
        "medium": LinkProfile("medium", uplink_mbit_s=150, downlink_mbit_s=1000),
        "strong": LinkProfile("strong", uplink_mbit_s=250, downlink_mbit_s=2500),
        "ideal": LinkProfile("ideal", uplink_mbit_s=math.inf, downlink_mbit_s=math.inf),
    }
)


def get_profile(
    name: str,
    delay_ms: float | None = None,
    jitter_ms: float | None = None,
    loss_pct: float | None = None,
) -> LinkProfile:
    """The named profile (case-insensitive), with any of delay/jitter/loss overridden."""
    profile = PROFILES.get(name.lower())
    if profile is None:
        raise ValueError(f"unknown link profile {name!r}; valid profiles: {', '.join(PROFILES)}")
    return dataclasses.replace(
        profile,
        delay_ms=profile.delay_ms if delay_ms is None else delay_ms,
        jitter_ms=profile.jitter_ms if jitter_ms is None else jitter_ms,
        loss_pct=profile.loss_pct if loss_pct is None else loss_pct,
    )
