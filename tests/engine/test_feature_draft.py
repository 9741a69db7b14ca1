"""The feature draft (asymspec_engine.feature_draft): the log of target features by
position, their bf16 wire form, and FeatureLM's arithmetic — chunked feeding equals one
forward, a draft step after the first reads the draft's own ĥ, and the serving layer
computes what the training script's unrolled passes computed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from asymspec_engine.embedded import REPO_ROOT
from asymspec_engine.feature_draft import (
    FeatureLM,
    FeatureLog,
    features_from_wire,
    features_to_wire,
    is_feature_draft,
    load_fc,
)
from asymspec_engine.hardware import resolve_precision
from asymspec_engine.loading import EngineOptions, load_session_lm
from loadtest.tiny_models import save_tiny_feature_draft, save_tiny_pair

sys.path.insert(0, str(REPO_ROOT / "scripts"))
from train_feature_draft import FeatureDraftNet


def rows(*values: float) -> torch.Tensor:
    """One feature row [v, v] per value (hidden size 2)."""
    return torch.tensor([[v, v] for v in values])


# ---------------------------------------------------------------- FeatureLog


def test_before_reads_the_feature_of_the_position_before_each_token() -> None:
    log = FeatureLog(hidden_size=2)
    log.extend(0, rows(10, 11, 12))  # h_0, h_1, h_2
    assert torch.equal(log.before(0, 3), rows(0, 10, 11))  # x_0 has no h before it
    assert torch.equal(log.before(2, 4), rows(11, 12))
    assert torch.equal(log.before(3, 4), rows(12))
    with pytest.raises(ValueError):
        log.before(3, 5)  # x_4 needs h_3, not sent yet


def test_a_verdict_overwrites_from_its_start_and_chunks_read_across() -> None:
    log = FeatureLog(hidden_size=2)
    log.extend(0, rows(10, 11, 12))
    log.extend(2, rows(22, 23))  # the next verdict starts at the last known position
    assert log.end == 4
    assert torch.equal(log.before(1, 5), rows(10, 11, 22, 23))
    log.extend(4, rows(24))
    log.extend(1, rows(31))  # a re-opened session: everything from position 1 on is replaced
    assert log.end == 2
    assert torch.equal(log.before(0, 3), rows(0, 10, 31))
    with pytest.raises(ValueError):
        log.before(0, 4)


def test_gaps_and_wrong_widths_are_refused() -> None:
    log = FeatureLog(hidden_size=2)
    log.extend(0, rows(10))
    with pytest.raises(ValueError):
        log.extend(2, rows(12))  # h_1 would be missing
    with pytest.raises(ValueError):
        log.extend(1, torch.zeros((1, 3)))
    with pytest.raises(ValueError):
        log.before(1, 1)  # empty


def test_wire_form_is_the_bf16_bit_pattern() -> None:
    features = torch.randn((5, 7), generator=torch.Generator().manual_seed(0))
    bits = features_to_wire(features)
    assert bits.dtype.name == "uint16" and bits.shape == (5, 7)
    assert torch.equal(features_from_wire(bits), features.to(torch.bfloat16))


# ---------------------------------------------------------------- FeatureLM


@pytest.fixture(scope="module")
def feature_draft_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    target, _ = save_tiny_pair(tmp_path_factory.mktemp("pair"))
    return save_tiny_feature_draft(target, tmp_path_factory.mktemp("feature-draft"))


def load_feature_lm(folder: Path) -> FeatureLM:
    lm, _ = load_session_lm(
        str(folder), EngineOptions(device="cpu", precision=resolve_precision("float32", "cpu"))
    )
    assert isinstance(lm, FeatureLM)
    return lm


def test_a_folder_with_an_fc_loads_as_a_feature_draft(feature_draft_dir: Path) -> None:
    assert is_feature_draft(feature_draft_dir)
    lm = load_feature_lm(feature_draft_dir)
    assert lm.hidden_size == 64 and len(lm.engine.layers) == 1


def seeded(n: int, hidden: int, seed: int) -> tuple[list[int], torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 300, (n,), generator=generator).tolist()
    return ids, torch.randn((n, hidden), generator=generator)


def test_chunked_feeding_equals_one_forward(feature_draft_dir: Path) -> None:
    lm = load_feature_lm(feature_draft_dir)
    ids, prev = seeded(9, lm.hidden_size, seed=1)
    lm.open("whole", [])
    whole = lm.forward_new([("whole", ids)], [9], [prev])
    lm.open("chunks", ids[:4], prev[:4])
    parts = lm.forward_new([("chunks", ids[4:])], [5], [prev[4:]])
    torch.testing.assert_close(parts[0], whole[0][4:], rtol=1e-4, atol=1e-4)


def test_a_step_without_features_reads_the_drafts_own_feature(feature_draft_dir: Path) -> None:
    """Draft step 2 of a block: x_s goes in with ĥ_{s-1}, the draft's output at s - 1."""
    lm = load_feature_lm(feature_draft_dir)
    ids, prev = seeded(6, lm.hidden_size, seed=2)
    lm.open("own", ids[:5], prev[:5])
    own = lm.forward_new([("own", ids[5:])], [1], [None])[0]
    lm.open("given", ids[:4], prev[:4])
    _, out = lm.engine.forward_features(
        [("given", ids[4:5])],
        [0],
        [1],
        lm.fc(torch.cat([lm.engine.embed[ids[4:5]], prev[4:5]], -1)),
    )
    given = lm.forward_new([("given", ids[5:])], [1], [out[0]])[0]
    torch.testing.assert_close(own, given)
    lm.truncate("own", 4)  # ĥ of position 4 is gone with it
    with pytest.raises(ValueError):
        lm.forward_new([("own", ids[4:5])], [1], [None])


def test_serving_computes_the_training_passes(feature_draft_dir: Path) -> None:
    """FeatureDraftNet's pass 1 at s is the draft fed true features up to s; pass 2 at s is
    draft step 2 of the block starting at s - 1 (x_s fed with the draft's own ĥ_{s-1})."""
    lm = load_feature_lm(feature_draft_dir)
    checkpoint = AutoModelForCausalLM.from_pretrained(feature_draft_dir).eval()
    head = checkpoint.lm_head.weight.detach()
    net = FeatureDraftNet(
        checkpoint.config, lm.engine.embed.float(), head, checkpoint.model.norm.weight
    ).eval()
    net.load_state_dict(layer_state(checkpoint, load_fc(feature_draft_dir)))
    ids, prev = seeded(7, lm.hidden_size, seed=3)
    prev[0] = 0  # h_{-1}
    with torch.no_grad():
        passes = net(torch.tensor([ids]), prev[None], passes=2)
    pass1 = passes[0][0] @ head.T
    pass2 = passes[1][0] @ head.T
    lm.open("s", [])
    served1 = lm.forward_new([("s", ids)], [7], [prev])[0]
    torch.testing.assert_close(served1, pass1, rtol=1e-4, atol=1e-4)
    s = 5
    lm.open("b", ids[:s], prev[:s])  # the block starts at s - 1: x_{s-1} with h_{s-2}
    served2 = lm.forward_new([("b", ids[s : s + 1])], [1], [None])[0]
    torch.testing.assert_close(served2[0], pass2[s], rtol=1e-4, atol=1e-4)


def layer_state(checkpoint: LlamaForCausalLM, fc: torch.Tensor) -> dict[str, torch.Tensor]:
    """The one-layer checkpoint's weights under FeatureDraftNet's names."""
    layer = checkpoint.model.layers[0]
    state = {"fc.weight": fc.float()}
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        state[f"{name}.weight"] = getattr(layer.self_attn, name).weight.detach()
    for name in ("gate_proj", "up_proj", "down_proj"):
        state[f"{name}.weight"] = getattr(layer.mlp, name).weight.detach()
    state["input_layernorm"] = layer.input_layernorm.weight.detach()
    state["post_attention_layernorm"] = layer.post_attention_layernorm.weight.detach()
    state["norm"] = checkpoint.model.norm.weight.detach()
    return state
