"""Tiny random-weight Llama models, built in well under a second: the tests' engines and
the weights of the tiny pair (``loadtest.tiny_models``)."""

from __future__ import annotations

import copy

import torch
from transformers import LlamaConfig, LlamaForCausalLM

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
