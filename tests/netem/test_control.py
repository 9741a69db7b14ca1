"""The control endpoint over real HTTP: on the dry-run backend (the `--dry-run` flag's; no
root), and on a real veth in a namespace, where a PUT must change what the kernel shapes."""

from __future__ import annotations

import json
import subprocess
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from asymspec.links import get_profile
from loadtest.testbed import Testbed
from netem.linkshaper.control import ControlServer
from netem.linkshaper.route import route_device
from netem.linkshaper.runner import DryRunRunner, SubprocessRunner
from netem.linkshaper.settings import Settings
from netem.linkshaper.shaper import Egress, LinkShaper


@contextmanager
def serving(shaper: LinkShaper) -> Iterator[str]:
    server = ControlServer(shaper, "127.0.0.1", 0)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def call(method: str, url: str) -> tuple[int, str]:
    request = urllib.request.Request(url, method=method)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def call_json(method: str, url: str) -> tuple[int, Any]:
    status, body = call(method, url)
    return status, json.loads(body)


@pytest.fixture
def dry() -> Iterator[tuple[str, DryRunRunner]]:
    runner = DryRunRunner(out=None)
    shaper = LinkShaper([Egress("uplink", "eth1", runner)])
    with serving(shaper) as url:
        yield url, runner


def test_before_any_profile(dry: tuple[str, DryRunRunner]) -> None:
    url, _ = dry
    assert call("GET", f"{url}/profile")[0] == 503
    assert call("GET", f"{url}/health")[0] == 503
    status, text = call("GET", f"{url}/metrics")
    assert status == 200 and "asymspec_link_up 0.0" in text


def test_switch_with_overrides(dry: tuple[str, DryRunRunner]) -> None:
    url, runner = dry
    status, body = call_json("PUT", f"{url}/profile/medium?delay_ms=20&loss_pct=0.5")
    assert status == 200
    assert body["profile"] == "medium" and body["backend"] == "netem"
    assert (body["uplink_mbit_s"], body["delay_ms"], body["loss_pct"]) == (150, 20.0, 0.5)
    assert runner.commands[-1][-4:] == ("loss", "0.5%", "limit", "500")
    status, body = call_json("PUT", f"{url}/profile/ideal")
    assert status == 200 and body["uplink_mbit_s"] is None and body["switches_total"] == 1
    assert call_json("GET", f"{url}/profile")[1] == body
    assert call("GET", f"{url}/health")[0] == 200
    metrics = call("GET", f"{url}/metrics")[1]
    assert 'asymspec_link_profile_info{profile="ideal",backend="none"' in metrics
    assert "asymspec_link_profile_switches_total 1.0" in metrics


@pytest.mark.parametrize(
    ("path", "status"),
    [
        ("/profile/fast", 400),  # unknown profile
        ("/profile/weak?delay_ms=abc", 400),
        ("/profile/weak?delay_ms=-1", 400),
        ("/profile/weak?bandwidth=9", 400),
        ("/profile/", 404),
        ("/metrics", 404),
    ],
)
def test_bad_puts(dry: tuple[str, DryRunRunner], path: str, status: int) -> None:
    url, runner = dry
    got, body = call_json("PUT", url + path)
    assert got == status and "error" in body
    assert not runner.commands  # nothing was applied


def test_settings_from_env() -> None:
    env = {"LINK_PROFILE": "strong", "UPLINK_PEER": "cloud", "LINK_DELAY_MS": "12.5"}
    settings = Settings.from_env(env)
    assert (settings.link_profile, settings.uplink_peer, settings.delay_ms) == (
        "strong",
        "cloud",
        12.5,
    )
    assert (settings.control_port, settings.backend, settings.jitter_ms) == (9100, "auto", None)
    with pytest.raises(ValueError, match="LINK_BACKEND"):
        Settings.from_env({"LINK_BACKEND": "cake"})


def test_route_device() -> None:
    line = "10.77.0.2 dev wan0 src 10.77.0.1 uid 0 \\    cache "
    assert route_device(line) == "wan0"
    with pytest.raises(ValueError):
        route_device("RTNETLINK answers: Network is unreachable")


def test_real_veth(bare_testbed: Testbed) -> None:
    layout = bare_testbed.layout
    runner = SubprocessRunner(layout.netns("cloud"))
    shaper = LinkShaper([Egress("downlink", layout.iface, runner)])
    shaper.apply(get_profile("weak"))
    show_class = bare_testbed.command("cloud", ["tc", "class", "show", "dev", layout.iface])
    with serving(shaper) as url:
        status, body = call_json("PUT", f"{url}/profile/strong")
        assert status == 200 and body["egresses"] == {"downlink": layout.iface}
        shown = subprocess.run(show_class, capture_output=True, text=True, check=True).stdout
        assert body["delay_emulated"] is (body["backend"] == "netem")
        if body["backend"] == "htb":  # this kernel: no sch_netem
            assert "rate 2500Mbit ceil 2500Mbit" in shown
    # the sidecar also learns the interface from the route to its peer
    peer_runner = SubprocessRunner(layout.netns("edge"))
    route = peer_runner.run(["ip", "-o", "route", "get", layout.cloud_address])
    assert route_device(route.stdout) == layout.iface
