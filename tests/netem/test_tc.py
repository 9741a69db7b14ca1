"""The tc/ethtool command builders: exact lines, queue sizing from the BDP, error triage."""

from __future__ import annotations

import pytest

from asymspec.links import get_profile
from netem.linkshaper.tc import (
    MIN_QUEUE_PACKETS,
    UNSHAPED_QUEUE_PACKETS,
    EgressShape,
    clear_commands,
    egress_shape,
    htb_commands,
    htb_root_present,
    netem_commands,
    netem_missing,
    nothing_to_clear,
    offload_commands,
)


def argv(shell_line: str) -> list[str]:
    return shell_line.split()


def test_queue_is_the_bdp_in_frames() -> None:
    profile = get_profile("weak", delay_ms=20, jitter_ms=2)
    # 50e6 / 8 B/s × 2 × (20 + 2) ms = 275,000 B -> 183.3 frames of 1500 B, rounded up
    assert egress_shape(profile, "uplink").queue_packets == 184
    # 150e6 / 8 × 0.044 = 825,000 B -> 550 frames
    assert egress_shape(profile, "downlink").queue_packets == 550


def test_queue_floor_and_unshaped() -> None:
    assert egress_shape(get_profile("strong"), "downlink").queue_packets == MIN_QUEUE_PACKETS
    ideal = egress_shape(get_profile("ideal", delay_ms=5), "uplink")
    assert ideal.queue_packets == UNSHAPED_QUEUE_PACKETS and not ideal.rate_limited


def test_netem_full_line() -> None:
    shape = egress_shape(get_profile("weak", delay_ms=20, jitter_ms=2.5, loss_pct=0.1), "uplink")
    # limit: 50e6 / 8 B/s × 2 × (20 + 2.5) ms = 281,250 B -> 187.5 frames, rounded up
    assert netem_commands("eth1", shape) == [
        argv(
            "tc qdisc replace dev eth1 root netem rate 50000kbit delay 20ms 2500us"
            " loss 0.1% limit 188"
        )
    ]


def test_netem_rate_only_and_delay_only() -> None:
    rate_only = netem_commands("wan0", egress_shape(get_profile("medium"), "downlink"))
    assert rate_only == [argv("tc qdisc replace dev wan0 root netem rate 1000000kbit limit 100")]
    delay_only = netem_commands("wan0", egress_shape(get_profile("ideal", delay_ms=5), "uplink"))
    assert delay_only == [argv("tc qdisc replace dev wan0 root netem delay 5ms limit 1000")]


def test_nothing_to_emulate_clears() -> None:
    ideal = egress_shape(get_profile("ideal"), "uplink")
    assert netem_commands("wan0", ideal) == clear_commands("wan0")
    assert htb_commands("wan0", ideal) == clear_commands("wan0")
    assert clear_commands("wan0") == [["tc", "qdisc", "del", "dev", "wan0", "root"]]


def test_htb_lines() -> None:
    weak_up = egress_shape(get_profile("weak"), "uplink")
    # burst: 1 ms at 50 Mbit/s is 6,250 B, below the 10-frame floor of 15,000 B;
    # quantum: 6.25e6 B/s / r2q 10 = 625,000 B, clamped to htb's 200,000.
    assert htb_commands("wan0", weak_up) == [
        argv("tc qdisc replace dev wan0 root handle 1: htb default 1"),
        argv(
            "tc class replace dev wan0 parent 1: classid 1:1 htb rate 50000kbit ceil 50000kbit"
            " burst 15000 cburst 15000 quantum 200000"
        ),
        argv("tc qdisc replace dev wan0 parent 1:1 handle 10: pfifo limit 100"),
    ]


def test_htb_switch_keeps_the_root() -> None:
    strong_down = egress_shape(get_profile("strong"), "downlink")
    lines = htb_commands("wan0", strong_down, root_present=True)
    assert [line[:2] for line in lines] == [["tc", "class"], ["tc", "qdisc"]]
    assert "312500" in lines[0]  # burst: 1 ms at 2500 Mbit/s


def test_htb_ignores_delay_it_cannot_emulate() -> None:
    plain = htb_commands("wan0", EgressShape(rate_mbit_s=150))
    delayed = htb_commands("wan0", EgressShape(rate_mbit_s=150, delay_ms=30, loss_pct=1))
    assert plain == delayed


def test_offloads_off() -> None:
    assert offload_commands("eth0") == [
        ["ethtool", "-K", "eth0", "tso", "off", "gso", "off", "gro", "off"]
    ]


@pytest.mark.parametrize(
    ("stderr", "missing"),
    [
        ("Error: Specified qdisc kind is unknown.", True),
        ('Unknown qdisc "netem", hence option "rate" is unparsable', True),
        ('Cannot find device "eth9"', False),
        ("Error: Exclusivity flag on, cannot modify.", False),
    ],
)
def test_netem_missing(stderr: str, missing: bool) -> None:
    assert netem_missing(stderr) is missing


def test_nothing_to_clear() -> None:
    assert nothing_to_clear("Error: Cannot delete qdisc with handle of zero.")
    assert not nothing_to_clear('Cannot find device "eth9"')


def test_htb_root_present() -> None:
    ours = "qdisc htb 1: root refcnt 3 r2q 10 default 0x1 direct_packets_stat 0 direct_qlen 1000"
    assert htb_root_present(ours)
    assert not htb_root_present("qdisc noqueue 0: root refcnt 2")
    assert not htb_root_present("qdisc netem 8001: root refcnt 2 limit 1000")
    assert not htb_root_present("")
