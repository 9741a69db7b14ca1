"""Tiny random-weight Llama models, built in well under a second, for the backend tests.

The builders are plain functions so that other test folders can import them
(``from tests.engine.conftest import build_tiny_llama``) without copying them.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from asymspec_engine.draft import DraftModel
from asymspec_engine.engine import CachedLM, SessionLM
from asymspec_engine.feature_draft import FeatureLM
from asymspec_engine.llama import LlamaEngine
from asymspec_engine.loading import session_lm
from asymspec_engine.target import TargetModel

TINY_VOCAB = 96


def build_tiny_llama(
    seed: int, hidden_size: int = 64, vocab_size: int = TINY_VOCAB
) -> LlamaForCausalLM:
    """A 2-layer Llama with GQA (4 heads, 2 KV heads) and seeded random weights."""
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        # Larger than the default 0.02, so that the rows are peaked like a trained model's
        # rather than near uniform (greedy argmaxes are then far from ties).
        initializer_range=0.2,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


def noisy_copy(model: LlamaForCausalLM, noise_std: float, seed: int) -> LlamaForCausalLM:
    """The model with Gaussian noise on every weight: a draft that agrees only partly."""
    draft = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in draft.parameters():
            param.add_(noise_std * torch.randn(param.shape, generator=generator))
    return draft.eval()


def feature_copy(
    target: LlamaForCausalLM, feature_weight: float = 0.3, seed: int = 2
) -> tuple[LlamaForCausalLM, torch.Tensor]:
    """A one-layer feature draft of a tiny target (``asymspec_engine.feature_draft``): the
    target with all but its first layer dropped, and an fc whose input is embed(x_s) +
    ``feature_weight`` * R h_{s-1} (R seeded random), so that its q agrees with the target's
    p in part and depends on the target features it is fed. (layer model, fc weight)."""
    config = target.config.to_dict()
    config["num_hidden_layers"] = 1
    draft = type(target)(type(target.config).from_dict(config)).eval()
    kept = {
        k: v
        for k, v in target.state_dict().items()
        if not k.startswith("model.layers.") or k.startswith("model.layers.0.")
    }
    draft.load_state_dict(kept)
    hidden = target.config.hidden_size
    mix = torch.randn((hidden, hidden), generator=torch.Generator().manual_seed(seed))
    return draft, torch.cat([torch.eye(hidden), feature_weight * mix / hidden**0.5], dim=1)


def feature_draft_lm(target: LlamaForCausalLM, feature_weight: float = 0.3) -> FeatureLM:
    """``feature_copy`` loaded as the edge loads a feature draft."""
    model, fc = feature_copy(target, feature_weight)
    engine = session_lm(model)
    assert isinstance(engine, LlamaEngine)
    return FeatureLM(engine, fc)


def full_logits(model: LlamaForCausalLM, token_ids: Sequence[int]) -> torch.Tensor:
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
