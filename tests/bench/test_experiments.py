"""The pure parts of the SPADE calibration and the fidelity experiment."""

from __future__ import annotations

import numpy as np
import pytest

from asymspec.sampling import residual
from asymspec.testbed import Testbed, TestbedLayout
from loadtest.bench.cell import service_envs
from loadtest.bench.cli import build_parser, config_from_args
from loadtest.bench.config import ModelPair
from scripts.fidelity_experiment import fidelity_at_k
from scripts.spade_calibrate import choose_gamma, exact_match_rate


def test_choose_gamma_takes_the_fastest_and_the_smaller_on_ties() -> None:
    rows = [
        {"gamma": 1, "throughput_tok_s": 10.0},
        {"gamma": 4, "throughput_tok_s": 14.0},
        {"gamma": 6, "throughput_tok_s": 14.0},
        {"gamma": 8, "throughput_tok_s": 9.0},
    ]
    assert choose_gamma(rows) == 4


def test_exact_match_rate_counts_failures_as_mismatches() -> None:
    assert exact_match_rate(["a", "b", None, "d"], ["a", "x", "c", "d"]) == 0.5
    assert exact_match_rate([], []) == 0.0


def row(values: dict[int, float], vocab: int = 8) -> np.ndarray:
    out = np.zeros(vocab, dtype=np.float32)
    for token, prob in values.items():
        out[token] = prob
    return out


def test_fidelity_at_k_matches_a_hand_computed_residual() -> None:
    p = row({0: 0.5, 1: 0.3, 2: 0.1, 3: 0.1})
    q = row({0: 0.7, 1: 0.1, 2: 0.0, 3: 0.2})
    # [p - q]+ = token 1: 0.2, token 2: 0.1 -> r = (0, 2/3, 1/3, 0); Z = 0.3
    # K=1: S={0}, Z_S=0 -> nothing drawable, TV 1; K=2: S={0,1}, Z_S=0.2, tail 0.1
    one = fidelity_at_k(p, q, 1)
    assert one["residual_tv"] == 1.0 and one["drawable"] == 0.0 and one["eps_k"] == 1.0
    assert one["recall_top1"] == 0.0
    two = fidelity_at_k(p, q, 2)
    assert two["residual_tv"] == pytest.approx(1 / 3)
    assert two["delta_p"] == pytest.approx(0.2)
    assert two["eps_k"] == pytest.approx(0.2 / (0.2 + 0.2))
    assert two["recall_top1"] == 1.0 and two["recall_top5"] == 0.5  # r has 2 positive tokens
    # The TV equals half the L1 distance to r restricted to S and renormalised.
    r = residual(p, q)
    restricted = np.where(np.isin(np.arange(8), [0, 1]), np.maximum(p - q, 0), 0)
    restricted = restricted / restricted.sum()
    assert two["residual_tv"] == pytest.approx(0.5 * np.abs(r - restricted).sum())
    three = fidelity_at_k(p, q, 3)
    assert three["residual_tv"] == pytest.approx(0.0, abs=1e-7)
    assert three["eps_k"] <= 0.1 / 0.4 + 1e-7  # the certificate bounds the true distance


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
