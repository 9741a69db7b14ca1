"""Fixtures for the engine tests: tiny random-weight Llama models (``loadtest.tiny_llama``),
built in well under a second, on every engine."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import pytest
import torch
from transformers import LlamaForCausalLM

from asymspec_engine.draft import DraftModel
from asymspec_engine.engine import CachedLM, SessionLM
from asymspec_engine.feature_draft import FeatureLM
from asymspec_engine.llama import LlamaEngine
from asymspec_engine.loading import session_lm
from asymspec_engine.target import TargetModel
from loadtest.tiny_llama import build_tiny_llama, feature_copy


def feature_draft_lm(target: LlamaForCausalLM, feature_weight: float = 0.3) -> FeatureLM:
    """``feature_copy`` loaded as the edge loads a feature draft."""
    model, fc = feature_copy(target, feature_weight)
    engine = session_lm(model)
    assert isinstance(engine, LlamaEngine)
    return FeatureLM(engine, fc)


def full_logits(model: torch.nn.Module, token_ids: Sequence[int]) -> torch.Tensor:
    """Logits [n, V] from recomputing the whole sequence without any cache."""
    with torch.inference_mode():
        return model(torch.tensor([list(token_ids)])).logits[0].float()


@contextmanager
def one_torch_thread() -> Iterator[None]:
    """Tiny forwards are dominated by thread hand-offs; on a shared 2-core machine two
    threads made them ~10x slower. Restored afterwards, as the setting is process-wide."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    with one_torch_thread():
        yield


@pytest.fixture(scope="session")
def tiny_target_model() -> LlamaForCausalLM:
    return build_tiny_llama(seed=0, hidden_size=64)


@pytest.fixture(scope="session")
def tiny_draft_model() -> LlamaForCausalLM:
    """An independent, smaller model: it agrees with the target about as often as chance."""
    return build_tiny_llama(seed=1, hidden_size=32)


ENGINES: dict[str, type[CachedLM] | type[LlamaEngine]] = {
    "CachedLM": CachedLM,  # transformers, the fallback for other architectures
    "LlamaEngine": LlamaEngine,  # what session_lm picks for these tiny Llamas
}


@pytest.fixture(params=sorted(ENGINES))
def engine_cls(request: pytest.FixtureRequest) -> type[CachedLM] | type[LlamaEngine]:
    """Every engine test runs on both engines: they promise the same logits."""
    return ENGINES[request.param]


@pytest.fixture
def target_lm(
    engine_cls: type[CachedLM] | type[LlamaEngine], tiny_target_model: LlamaForCausalLM
) -> SessionLM:
    return engine_cls(tiny_target_model)  # fresh caches per test; the weights are shared


@pytest.fixture
def target(tiny_target_model: LlamaForCausalLM) -> TargetModel:
    return TargetModel(session_lm(tiny_target_model))


@pytest.fixture
def draft(tiny_draft_model: LlamaForCausalLM) -> DraftModel:
    return DraftModel(session_lm(tiny_draft_model))
