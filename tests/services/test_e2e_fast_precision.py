"""The machine's fast default precision, end to end: both services in bfloat16 on CPUs
with AMX-BF16 / AVX512-BF16, in float32 with float16 weights (FBGEMM) on other AVX2 CPUs.

Acceptance and recovery are exact with respect to the p the verifier computes, so the first
three tokens still follow the target's joint, where "the target" is now the model as the
engine runs it in that precision (the exact joint below is computed with the same engine
and precision). Greedy identity with target-only is *not* asserted here: reduced-precision
batch numerics can flip a near-tie between a 5-row verify and a 1-row decode; the float32
mode guarantees it (test_e2e.py), and scripts/bench_backends.py --dtype reports the rate.
Where bf16 is emulated (AVX2), its products round differently with the row count (a 1-row
decode against an 8-row prefill), enough to move top-k cut-offs of this tiny random model,
so bf16 is only tested where it is native and the default.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from asymspec.sampling import SamplingParams, transform
from asymspec_engine.hardware import cpu_has_native_bf16, fp16_weights_supported
from asymspec_engine.llama import LlamaEngine
from tests.services.processes import Service, cloud_env, edge_env, free_port, running, running_all
from tests.services.test_e2e import (
    PROMPT_IDS,
    chi_square_pvalue,
    complete,
    sample_first_tokens,
)
from tests.services.tiny_models import save_tiny_pair

# The precision setting under test, and (model dtype, fp16 weights) for the exact joint.
PRECISION = (
    "bfloat16" if cpu_has_native_bf16() else "float16-weights" if fp16_weights_supported() else ""
)
MODEL_DTYPE, FP16_WEIGHTS = (
    (torch.bfloat16, False) if PRECISION == "bfloat16" else (torch.float32, True)
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not PRECISION, reason="no fast precision on this CPU: float32 only"),
]


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return save_tiny_pair(tmp_path_factory.mktemp("pair-fast"))


@pytest.fixture(scope="module")
def edges(
    pair: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Service]]:
    logs = tmp_path_factory.mktemp("logs-fast")
    with ExitStack() as stack:
        cloud_port = free_port()
        env = cloud_env(pair[0], cloud_port, dtype=PRECISION)
        stack.enter_context(running("cloud_verifier", cloud_port, env, logs))
        specs = {}
        for mode in ("asymspec", "target-only"):
            port = free_port()
            env = edge_env(pair[1], port, cloud_port, mode, dtype=PRECISION, max_model_len="512")
            specs[mode] = ("edge_gateway", port, env)
        yield stack.enter_context(running_all(specs, logs))


def exact_joint(
    target_dir: Path, params: SamplingParams, length: int
) -> dict[tuple[int, ...], float]:
    """P(first ``length`` tokens) under the target as LlamaEngine computes its rows in
    the precision under test."""
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=MODEL_DTYPE).eval()
    engine = LlamaEngine(model, fp16_weights=FP16_WEIGHTS)
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
def test_first_three_tokens_follow_the_target_in_that_precision(
    edges: dict[str, Service], pair: tuple[Path, Path], mode: str
) -> None:
    n, top_k = 2000, 4
    joint = exact_joint(pair[0], SamplingParams(temperature=1.0, top_k=top_k), 3)
    counts = asyncio.run(sample_first_tokens(edges[mode], n, top_k))
    assert sum(counts.values()) == n
    assert chi_square_pvalue(joint, counts) > 0.001


def test_services_serve_greedy_in_that_precision(edges: dict[str, Service]) -> None:
    body = {"prompt": PROMPT_IDS, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    for edge in edges.values():
        assert complete(edge, **body)["usage"]["completion_tokens"] == 16
