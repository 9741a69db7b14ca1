"""The shaper: backend choice, the lines it runs, switching; on the dry-run backend (no root)
and on a real veth (root): this kernel has no sch_netem, so there it must fall back to htb."""

from __future__ import annotations

import logging
import subprocess

import pytest

from asymspec.links import get_profile
from loadtest.testbed import Side, Testbed
from netem.linkshaper.runner import DryRunRunner, SubprocessRunner
from netem.linkshaper.shaper import BackendChoice, Egress, LinkShaper


def dry_shaper(backend: BackendChoice = "auto") -> tuple[LinkShaper, DryRunRunner]:
    runner = DryRunRunner(out=None)
    egresses = [Egress("uplink", "eth1", runner), Egress("downlink", "eth2", runner)]
    return LinkShaper(egresses, backend=backend), runner


def test_auto_uses_netem_when_it_works() -> None:
    shaper, runner = dry_shaper()
    state = shaper.apply(get_profile("weak", delay_ms=10))
    assert (state.backend, state.delay_emulated, state.switches_total) == ("netem", True, 0)
    tc_lines = [" ".join(c) for c in runner.commands if c[0] == "tc"]
    assert tc_lines == [
        "tc qdisc replace dev eth1 root netem rate 50000kbit delay 10ms limit 100",
        # 150e6 / 8 B/s × 2 × 10 ms = 375,000 B = 250 frames; the uplink's 125 is under the floor
        "tc qdisc replace dev eth2 root netem rate 150000kbit delay 10ms limit 250",
    ]
    # offloads off once per interface, before the first shaping
    assert [c[2] for c in runner.commands if c[0] == "ethtool"] == ["eth1", "eth2"]


def test_forced_htb_warns_that_delay_is_not_emulated(caplog: pytest.LogCaptureFixture) -> None:
    shaper, runner = dry_shaper(backend="htb")
    with caplog.at_level(logging.WARNING):
        state = shaper.apply(get_profile("medium", delay_ms=25))
    assert (state.backend, state.delay_emulated) == ("htb", False)
    assert "NOT emulated" in caplog.text
    assert any("htb" in c and "1000000kbit" in c for c in runner.commands)


def test_switches_count_and_ideal_clears() -> None:
    shaper, runner = dry_shaper()
    shaper.apply(get_profile("weak"))
    runner.commands.clear()
    state = shaper.apply(get_profile("ideal"))
    assert (state.backend, state.switches_total) == ("none", 1)
    assert runner.commands == [
        ("tc", "qdisc", "del", "dev", "eth1", "root"),
        ("tc", "qdisc", "del", "dev", "eth2", "root"),
    ]
    assert shaper.apply(get_profile("strong")).switches_total == 2


def test_needs_an_interface() -> None:
    with pytest.raises(ValueError, match="nothing to shape"):
        LinkShaper([])


def qdisc_lines(bed: Testbed, side: Side) -> str:
    argv = bed.command(side, ["tc", "qdisc", "show", "dev", bed.layout.iface])
    return subprocess.run(argv, capture_output=True, text=True, check=True).stdout


def class_lines(bed: Testbed, side: Side) -> str:
    argv = bed.command(side, ["tc", "class", "show", "dev", bed.layout.iface])
    return subprocess.run(argv, capture_output=True, text=True, check=True).stdout


def test_real_kernel_backend_and_live_switch(bare_testbed: Testbed) -> None:
    iface = bare_testbed.layout.iface
    shaper = LinkShaper(
        [Egress("uplink", iface, SubprocessRunner(bare_testbed.layout.netns("edge")))]
    )
    state = shaper.apply(get_profile("weak"))
    shown = qdisc_lines(bare_testbed, "edge")
    # Whichever backend the kernel allows, the kernel must show that one shaping at 50 Mbit/s.
    assert f"qdisc {state.backend}" in shown
    if state.backend == "htb":
        assert "rate 50Mbit ceil 50Mbit" in class_lines(bare_testbed, "edge")
        shaper.apply(get_profile("medium"))  # htb cannot `change`: the root must be kept
        assert "rate 150Mbit ceil 150Mbit" in class_lines(bare_testbed, "edge")
    else:
        assert "rate 50Mbit" in shown
    shaper.clear()
    assert "qdisc htb" not in qdisc_lines(bare_testbed, "edge")
    assert "qdisc netem" not in qdisc_lines(bare_testbed, "edge")
