"""Link profiles: the paper's numbers, overrides, and transfer-time arithmetic."""

from __future__ import annotations

import math

import pytest

from asymspec.links import PROFILES, LinkProfile, get_profile


@pytest.mark.parametrize(
    ("name", "up", "down"),
    [("weak", 50, 150), ("medium", 150, 1000), ("strong", 250, 2500)],
)
def test_paper_profiles(name: str, up: float, down: float) -> None:
    profile = PROFILES[name]
    assert profile.name == name
    assert (profile.uplink_mbit_s, profile.downlink_mbit_s) == (up, down)
    assert (profile.delay_ms, profile.jitter_ms, profile.loss_pct) == (0, 0, 0)
    assert profile.shaped


def test_ideal_is_unshaped() -> None:
    ideal = PROFILES["ideal"]
    assert ideal.uplink_mbit_s == math.inf and ideal.downlink_mbit_s == math.inf
    assert not ideal.shaped
    assert ideal.uplink_seconds(10**9) == 0.0 and ideal.downlink_seconds(10**9) == 0.0
    assert ideal.uplink_bdp_bytes() == math.inf
    assert get_profile("ideal", delay_ms=5).shaped  # delay alone still needs netem


def test_profiles_mapping_is_read_only() -> None:
    assert set(PROFILES) == {"weak", "medium", "strong", "ideal"}
    with pytest.raises(TypeError):
        PROFILES["fast"] = PROFILES["ideal"]  # type: ignore[index]


def test_overrides() -> None:
    profile = get_profile("medium", delay_ms=20, jitter_ms=2.5, loss_pct=0.1)
    assert (profile.uplink_mbit_s, profile.downlink_mbit_s) == (150, 1000)
    assert (profile.delay_ms, profile.jitter_ms, profile.loss_pct) == (20, 2.5, 0.1)
    assert get_profile("medium", delay_ms=20).jitter_ms == 0  # unset overrides keep defaults
    assert get_profile("Weak") == PROFILES["weak"]
    assert PROFILES["medium"].delay_ms == 0  # the shared profile is untouched


def test_unknown_profile_names_valid_ones() -> None:
    with pytest.raises(ValueError, match="unknown link profile 'lte'") as info:
        get_profile("lte")
    for name in ("weak", "medium", "strong", "ideal"):
        assert name in str(info.value)


@pytest.mark.parametrize(
    "kwargs", [{"delay_ms": -1}, {"jitter_ms": -0.5}, {"loss_pct": 101}, {"loss_pct": -1}]
)
def test_invalid_overrides(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        get_profile("weak", **kwargs)


def test_invalid_rates() -> None:
    with pytest.raises(ValueError):
        LinkProfile("broken", uplink_mbit_s=0, downlink_mbit_s=10)
    with pytest.raises(ValueError):
        LinkProfile("broken", uplink_mbit_s=10, downlink_mbit_s=math.nan)


def test_transfer_seconds() -> None:
    weak = PROFILES["weak"]
    # 1 Mbit = 10^6 bit: 6.25 MB is 50 Mbit, one second up at 50 Mbit/s, 1/3 s down at 150.
    assert weak.uplink_seconds(6_250_000) == pytest.approx(1.0)
    assert weak.downlink_seconds(6_250_000) == pytest.approx(1 / 3)
    # A compact γ=4 block (58 bytes with WebSocket framing) vs a full upload (~393 KB).
    assert weak.uplink_seconds(58) == pytest.approx(58 * 8 / 50e6)
    assert weak.uplink_seconds(393_269) == pytest.approx(0.06292304)
    assert PROFILES["strong"].downlink_seconds(0) == 0
    with pytest.raises(ValueError):
        weak.uplink_seconds(-1)


def test_bandwidth_delay_product() -> None:
    profile = get_profile("weak", delay_ms=20, jitter_ms=5)
    # rate × worst-case RTT: 50e6/8 B/s × 2 × 25 ms = 312,500 B up; 937,500 B down.
    assert profile.uplink_bdp_bytes() == pytest.approx(312_500)
    assert profile.downlink_bdp_bytes() == pytest.approx(937_500)
    assert PROFILES["weak"].uplink_bdp_bytes() == 0  # no delay: nothing in flight to queue
