"""The local testbed: its command lines (pure), teardown on error, and (slow, root) the
rates it really carries under the weak and medium profiles."""

from __future__ import annotations

import subprocess

import pytest

from asymspec.links import get_profile
from loadtest.testbed import (
    RATE_TOLERANCE,
    RateCheck,
    Testbed,
    TestbedLayout,
    create_commands,
    destroy_commands,
    netns_command,
    open_testbed,
)
from tests.netem.conftest import netns_names


def test_layout_names_are_unique_per_run() -> None:
    first, second = TestbedLayout.new(), TestbedLayout.new()
    assert first.netns("edge") != second.netns("edge")
    layout = TestbedLayout(run_id="abc123", prefix="t")
    assert (layout.netns("edge"), layout.netns("cloud")) == ("t-edge-abc123", "t-cloud-abc123")


def test_create_and_destroy_commands() -> None:
    lines = [" ".join(argv) for argv in create_commands(TestbedLayout(run_id="r", prefix="t"))]
    assert lines[:3] == [
        "ip netns add t-edge-r",
        "ip netns add t-cloud-r",
        "ip link add wan0 netns t-edge-r type veth peer name wan0 netns t-cloud-r",
    ]
    assert "ip -n t-edge-r addr add 10.77.0.1/30 dev wan0" in lines
    assert "ip -n t-cloud-r addr add 10.77.0.2/30 dev wan0" in lines
    assert "ip -n t-cloud-r link set lo up" in lines
    destroy = destroy_commands(TestbedLayout(run_id="r", prefix="t"))
    assert destroy == [["ip", "netns", "del", "t-edge-r"], ["ip", "netns", "del", "t-cloud-r"]]


def test_netns_command_pins() -> None:
    assert netns_command("ns", ["python", "-m", "cloud_verifier"], cpu=1) == [
        "ip", "netns", "exec", "ns", "taskset", "-c", "1", "python", "-m", "cloud_verifier"
    ]  # fmt: skip
    assert netns_command("ns", ["true"]) == ["ip", "netns", "exec", "ns", "true"]


def test_teardown_on_error(netns_ok: None) -> None:
    layout = TestbedLayout.new(prefix="asymspec-test")
    with pytest.raises(RuntimeError, match="boom"), open_testbed("ideal", layout) as bed:
        show = bed.command("edge", ["ip", "-br", "addr", "show", layout.iface])
        assert layout.edge_address in subprocess.run(show, capture_output=True, text=True).stdout
        raise RuntimeError("boom")
    assert not {layout.netns("edge"), layout.netns("cloud")} & netns_names()


@pytest.mark.slow
def test_weak_then_medium_rates(netns_ok: None) -> None:
    """~15 s: weak up and down, then medium up, each a 3 s TCP transfer."""
    layout = TestbedLayout.new(prefix="asymspec-test")
    with open_testbed("weak", layout) as bed:
        for check in bed.check(seconds=3.0):
            assert check.ok, f"weak {check.direction}: {check.as_dict()}"
        state = bed.switch(get_profile("medium"))
        assert state.switches_total == 1
        medium_up = RateCheck("uplink", 150, bed.measure("uplink", seconds=3.0))
        assert abs(medium_up.ratio - 1) <= RATE_TOLERANCE, medium_up.as_dict()
    assert not {layout.netns("edge"), layout.netns("cloud")} & netns_names()


def test_name_clash_leaves_the_other_run_alone(bare_testbed: Testbed) -> None:
    with pytest.raises(RuntimeError, match="File exists"):
        Testbed(bare_testbed.layout).create()
    layout = bare_testbed.layout
    assert {layout.netns("edge"), layout.netns("cloud")} <= netns_names()
