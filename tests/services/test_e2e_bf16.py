"""The default dtype on CPUs with AMX-BF16 / AVX512-BF16: both services in bfloat16.

Acceptance and recovery are exact with respect to the p the verifier computes, so in bf16
the first three tokens still follow the target's joint, where "the target" is now the bf16
model as the engine runs it (the exact joint below is computed with the same engine and
dtype). Greedy identity with target-only is *not* asserted here: bf16 batch numerics can
flip a near-tie between a 5-row verify and a 1-row decode; the float32 mode guarantees it
(test_e2e.py), and scripts/bench_backends.py --dtype bfloat16 reports the bf16 rate.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from asymspec.backends.llama import LlamaEngine
from asymspec.sampling import SamplingParams, transform
from tests.services.processes import Service, cloud_env, edge_env, free_port, running
from tests.services.test_e2e import (
    PROMPT_IDS,
    chi_square_pvalue,
    complete,
    sample_first_tokens,
)
from tests.services.tiny_models import save_tiny_pair

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return save_tiny_pair(tmp_path_factory.mktemp("pair-bf16"))


@pytest.fixture(scope="module")
def edges(
    pair: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Service]]:
    logs = tmp_path_factory.mktemp("logs-bf16")
    with ExitStack() as stack:
        cloud_port = free_port()
        env = cloud_env(pair[0], cloud_port, dtype="bfloat16")
        stack.enter_context(running("cloud_verifier", cloud_port, env, logs))
        services = {}
        for mode in ("asymspec", "target-only"):
            port = free_port()
            env = edge_env(pair[1], port, cloud_port, mode, dtype="bfloat16", max_model_len="512")
            services[mode] = stack.enter_context(running("edge_gateway", port, env, logs))
        yield services


def bf16_exact_joint(
    target_dir: Path, params: SamplingParams, length: int
) -> dict[tuple[int, ...], float]:
    """P(first ``length`` tokens) under the bf16 target as LlamaEngine computes its rows."""
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.bfloat16).eval()
    engine = LlamaEngine(model)
    joint: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(length):
        grown = {}
        for seq, prob in joint.items():
            engine.open("s", [])
            (rows,) = engine.forward_new([("s", [*PROMPT_IDS, *seq])], keep_rows=[1])
            engine.close("s")
            row = transform(rows[-1], params).double()
            for token in torch.nonzero(row).flatten().tolist():
                grown[(*seq, token)] = prob * float(row[token] / row.sum())
        joint = grown
    return joint


@pytest.mark.parametrize("mode", ["asymspec", "target-only"])
def test_bf16_first_three_tokens_follow_the_bf16_target(
    edges: dict[str, Service], pair: tuple[Path, Path], mode: str
) -> None:
    n, top_k = 2000, 4
    joint = bf16_exact_joint(pair[0], SamplingParams(temperature=1.0, top_k=top_k), 3)
    counts = asyncio.run(sample_first_tokens(edges[mode], n, top_k))
    assert sum(counts.values()) == n
    assert chi_square_pvalue(joint, counts) > 0.001


def test_bf16_services_serve_greedy(edges: dict[str, Service]) -> None:
    body = {"prompt": PROMPT_IDS, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    for edge in edges.values():
        assert complete(edge, **body)["usage"]["completion_tokens"] == 16
