"""A benchmark cell's service settings and the command line that sets them."""

from __future__ import annotations

import pytest

from loadtest.bench.cell import service_envs
from loadtest.bench.cli import build_parser, config_from_args
from loadtest.bench.config import ModelPair
from loadtest.testbed import Testbed, TestbedLayout


@pytest.mark.parametrize("dtype", ["auto", "float32"])
def test_a_cell_runs_both_services_in_its_dtype(dtype: str) -> None:
    """SPADE's exact-match column needs the exact (float32) mode on both sides."""
    bed = Testbed(TestbedLayout.new())
    pair = ModelPair("embedded", "target-folder", "draft-folder")
    cloud, edge = service_envs(bed, "asymspec", pair, "a-secret-of-some-length", dtype)
    assert cloud["ASYMSPEC_CLOUD_DTYPE"] == edge["ASYMSPEC_EDGE_DTYPE"] == dtype


def test_cells_compare_mechanisms_unless_asked_for_the_goodput_pause() -> None:
    """The table's speculative modes speculate throughout; --goodput-pause measures what a
    user gets (the edge's default)."""
    bed = Testbed(TestbedLayout.new())
    pair = ModelPair("embedded", "target-folder", "draft-folder")
    _, edge = service_envs(bed, "asymspec", pair, "a-secret-of-some-length")
    assert edge["ASYMSPEC_EDGE_GOODPUT_PAUSE"] == "false"
    _, edge = service_envs(bed, "asymspec", pair, "a-secret-of-some-length", goodput_pause=True)
    assert edge["ASYMSPEC_EDGE_GOODPUT_PAUSE"] == "true"
    args = build_parser().parse_args(["--goodput-pause"])
    assert config_from_args(args).goodput_pause
    assert not config_from_args(build_parser().parse_args([])).goodput_pause
