"""How colocated services split the host's cores between their torch threads."""

from __future__ import annotations

import pytest

from asymspec.modes import get_mode
from asymspec_engine.hardware import colocated_threads
from cloud_verifier.settings import CloudSettings
from edge_gateway.settings import EdgeSettings


@pytest.mark.parametrize(
    ("mode", "cpus", "cloud", "edge"),
    [
        ("asymspec", 2, 1, 1),
        ("asymspec", 8, 6, 2),
        ("asymspec", 1, 1, 1),
        ("standard", 16, 12, 4),
        ("target-only", 2, 2, 1),  # the edge runs no model: the cloud takes every core
        ("target-only", 8, 8, 1),
        ("draft-only", 2, 1, 2),  # and the other way round
    ],
)
def test_colocated_split(mode: str, cpus: int, cloud: int, edge: int) -> None:
    assert colocated_threads("cloud", get_mode(mode), cpus) == cloud
    assert colocated_threads("edge", get_mode(mode), cpus) == edge


def test_services_read_the_shared_mode_for_the_split(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASYMSPEC_COLOCATED", "true")
    monkeypatch.setenv("ASYMSPEC_MODE", "target-only")
    monkeypatch.setattr("os.cpu_count", lambda: 4)
    cloud = CloudSettings(shared_secret="s" * 16)
    edge = EdgeSettings(shared_secret="s" * 16)
    assert (cloud.resolved_threads(), edge.resolved_threads()) == (4, 1)
    monkeypatch.delenv("ASYMSPEC_MODE")
    monkeypatch.setenv("ASYMSPEC_EDGE_MODE", "draft-only")  # the edge knows its own mode
    assert EdgeSettings(shared_secret="s" * 16).resolved_threads() == 4
    assert CloudSettings(shared_secret="s" * 16).resolved_threads() == 3  # asymspec
    monkeypatch.setenv("ASYMSPEC_CLOUD_THREADS", "2")  # an explicit count wins
    assert CloudSettings(shared_secret="s" * 16).resolved_threads() == 2
    monkeypatch.delenv("ASYMSPEC_COLOCATED")
    monkeypatch.delenv("ASYMSPEC_CLOUD_THREADS")
    assert CloudSettings(shared_secret="s" * 16).resolved_threads() is None
