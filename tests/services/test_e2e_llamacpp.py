"""Both services on the llama.cpp engine, end to end: the tiny pair written as GGUF files.

Acceptance and recovery are exact with respect to the p the verifier computes, so the first
three tokens follow the target's joint as llama.cpp computes its rows (the joint below is
computed with the same engine and file). Greedy identity with target-only is counted, not
asserted: a 5-row verify and a 1-row decode step may round a near-tie apart (float16 keys
and values, quantised activations); the torch engine's float32 mode guarantees it
(test_e2e.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest
import torch

from asymspec.sampling import SamplingParams, transform
from asymspec_engine.llamacpp import ENGINE_GGUF, LlamaCppEngine
from asymspec_engine.prepare import write_engine_gguf
from loadtest.processes import Service, cloud_env, edge_env, free_port, running_all
from loadtest.tiny_models import save_tiny_pair
from tests.services.test_e2e import PROMPT_IDS, chi_square_pvalue, complete, sample_first_tokens

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    target, draft = save_tiny_pair(tmp_path_factory.mktemp("pair-llamacpp"))
    for folder in (target, draft):
        write_engine_gguf(folder)  # what `make models` writes beside the embedded pair
    return target, draft


@pytest.fixture(scope="module")
def edges(
    pair: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Service]]:
    logs = tmp_path_factory.mktemp("logs-llamacpp")
    with ExitStack() as stack:
        cloud_port = free_port()
        specs = {"cloud": ("cloud_verifier", cloud_port, cloud_env(pair[0], cloud_port))}
        for mode in ("asymspec", "target-only"):
            port = free_port()
            env = edge_env(pair[1], port, cloud_port, mode, max_model_len="512")
            specs[mode] = ("edge_gateway", port, env)
        services = stack.enter_context(running_all(specs, logs))
        for name in ("cloud", "asymspec"):  # the engine each picked, and why
            assert "the llama.cpp engine (auto:" in services[name].logs()
        yield services


def exact_joint(
    target_dir: Path, params: SamplingParams, length: int
) -> dict[tuple[int, ...], float]:
    """P(first ``length`` tokens) under the target as the llama.cpp engine computes it."""
    engine = LlamaCppEngine(target_dir / ENGINE_GGUF, threads=1)
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
def test_first_three_tokens_follow_the_target_as_llama_cpp_computes_it(
    edges: dict[str, Service], pair: tuple[Path, Path], mode: str
) -> None:
    n, top_k = 2000, 4
    joint = exact_joint(pair[0], SamplingParams(temperature=1.0, top_k=top_k), 3)
    counts = asyncio.run(sample_first_tokens(edges[mode], n, top_k))
    assert sum(counts.values()) == n
    assert chi_square_pvalue(joint, counts) > 0.001


def test_greedy_output_is_served_and_mostly_identical(edges: dict[str, Service]) -> None:
    prompts = [[*PROMPT_IDS, t] for t in range(20, 30)]
    body = {"max_tokens": 24, "temperature": 0, "ignore_eos": True}
    outputs = {
        mode: [
            complete(edges[mode], prompt=p, return_token_ids=True, **body)["choices"][0][
                "token_ids"
            ]
            for p in prompts
        ]
        for mode in ("asymspec", "target-only")
    }
    same = sum(a == b for a, b in zip(outputs["asymspec"], outputs["target-only"], strict=True))
    assert all(len(o) == 24 for o in outputs["asymspec"])
    assert same >= len(prompts) // 2  # near-ties aside, the same text
