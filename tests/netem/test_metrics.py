"""The Prometheus text: parseable by the reference parser, names and values as documented."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from asymspec.links import get_profile
from netem.linkshaper.metrics import render_metrics
from netem.linkshaper.shaper import LinkState


def samples(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    found: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found.setdefault(sample.name, []).append((sample.labels, sample.value))
    return found


def test_htb_state() -> None:
    state = LinkState(get_profile("weak", delay_ms=20), "htb", 3, (("uplink", "wan0"),))
    found = samples(render_metrics(state))
    assert found["asymspec_link_profile_info"] == [
        ({"profile": "weak", "backend": "htb", "delay_emulated": "false"}, 1.0)
    ]
    assert found["asymspec_link_uplink_rate_bits_per_second"] == [({}, 50e6)]
    assert found["asymspec_link_downlink_rate_bits_per_second"] == [({}, 150e6)]
    assert found["asymspec_link_delay_seconds"] == [({}, 0.0)]  # asked for, not emulated
    assert found["asymspec_link_profile_switches_total"] == [({}, 3.0)]
    assert found["asymspec_link_shaped_iface_info"] == [
        ({"direction": "uplink", "iface": "wan0"}, 1.0)
    ]


def test_netem_state_and_unshaped_rates() -> None:
    profile = get_profile("ideal", delay_ms=20, jitter_ms=5, loss_pct=0.5)
    found = samples(render_metrics(LinkState(profile, "netem", 0, ())))
    assert found["asymspec_link_uplink_rate_bits_per_second"] == [({}, float("inf"))]
    assert found["asymspec_link_delay_seconds"] == [({}, 0.02)]
    assert found["asymspec_link_jitter_seconds"] == [({}, 0.005)]
    assert found["asymspec_link_loss_ratio"] == [({}, 0.005)]


def test_nothing_applied() -> None:
    assert samples(render_metrics(None)) == {"asymspec_link_up": [({}, 0.0)]}
