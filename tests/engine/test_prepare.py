"""Preparing the embedded model pair: atomic writes, stamps, errors, and the real pair."""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

import pytest

from asymspec_engine import prepare
from asymspec_engine.head_vocab import HEAD_VOCAB_FILE


def _stamp(folder: Path, **fields: object) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text("{}")
    (folder / prepare.STAMP_NAME).write_text(json.dumps(fields))


def test_current_only_with_matching_version_and_source(tmp_path: Path) -> None:
    _stamp(tmp_path / "a", version=prepare.PREPARE_VERSION, source_sha256="abc")
    _stamp(tmp_path / "b", version=prepare.PREPARE_VERSION - 1, source_sha256="abc")
    assert prepare.is_current(tmp_path / "a", "abc")
    assert not prepare.is_current(tmp_path / "a", "def")  # the source changed
    assert not prepare.is_current(tmp_path / "b", "abc")  # an older conversion
    assert not prepare.is_current(tmp_path / "missing", "abc")


def test_write_atomically_replaces_a_complete_folder(tmp_path: Path) -> None:
    final = tmp_path / "model"
    _stamp(final, version=0)

    def build(out: Path) -> None:
        (out / "config.json").write_text('{"new": true}')

    prepare.write_atomically(final, build, {"version": 7})
    assert json.loads((final / "config.json").read_text()) == {"new": True}
    assert json.loads((final / prepare.STAMP_NAME).read_text()) == {"version": 7}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # no temp or old left


def test_interrupted_build_leaves_no_half_checkpoint(tmp_path: Path) -> None:
    final = tmp_path / "model"

    def build(out: Path) -> None:
        (out / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt  # e.g. Ctrl-C during save_pretrained

    with pytest.raises(KeyboardInterrupt):
        prepare.write_atomically(final, build, {"version": 1})
    assert list(tmp_path.iterdir()) == []


def test_missing_gguf_package_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(prepare.PrepareError, match="make install"):
        prepare.gguf_path()


def test_missing_committed_draft_names_the_script(tmp_path: Path) -> None:
    with pytest.raises(prepare.PrepareError, match=r"distill_draft\.py"):
        prepare.committed_draft_files(tmp_path)


def test_main_reports_errors_without_a_traceback(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert prepare.main([]) == 1
    assert "make install" in capsys.readouterr().err


def test_committed_draft_is_small_enough() -> None:
    weights = prepare.COMMITTED_DRAFT_DIR / prepare.DRAFT_WEIGHTS
    assert weights.is_file(), "the draft checkpoint must be committed"
    assert weights.stat().st_size <= 40e6


@pytest.mark.slow
def test_prepared_pair_loads_shares_the_tokenizer_and_rerun_is_a_noop() -> None:
    prepare.prepare(log=lambda line: None)  # builds on a fresh cache, else already done
    started = time.perf_counter()
    assert prepare.prepare(log=lambda line: None) is False  # nothing rebuilt
    assert time.perf_counter() - started < 5.0
    facts = prepare.verify_pair(prepare.target_dir(), prepare.draft_dir())
    assert facts["vocab_size"] == 49152
    assert facts["draft_params"] < facts["target_params"] // 4  # type: ignore[operator]
    for name in ("tokenizer.json", "tokenizer_config.json"):
        target_file = prepare.target_dir() / name
        assert target_file.read_bytes() == (prepare.draft_dir() / name).read_bytes()
    committed_head = prepare.COMMITTED_DRAFT_DIR / HEAD_VOCAB_FILE  # the restricted head
    assert (prepare.draft_dir() / HEAD_VOCAB_FILE).read_bytes() == committed_head.read_bytes()


def test_a_committed_feature_draft_is_assembled_with_the_targets_embedding(
    tmp_path: Path,
) -> None:
    """The committed folder leaves out the embedding (it is the target's, tied as the head);
    the assembled checkpoint has it, its fc, and loads as a FeatureLM fed the same rows."""
    import torch
    from safetensors.torch import load_file, save_file

    from asymspec_engine.feature_draft import FeatureLM, save_fc
    from asymspec_engine.hardware import resolve_precision
    from asymspec_engine.loading import EngineOptions, load_session_lm
    from loadtest.tiny_llama import build_tiny_llama, feature_copy
    from loadtest.tiny_models import build_tokenizer

    tokenizer = build_tokenizer()
    target = build_tiny_llama(seed=0, hidden_size=64, vocab_size=len(tokenizer))
    target.config.tie_word_embeddings = True
    target.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    layer, fc = feature_copy(target)
    committed = tmp_path / "committed"
    committed.mkdir()
    config = layer.config.to_dict() | {"tie_word_embeddings": True}
    (committed / "config.json").write_text(json.dumps(config))
    weights = {
        name: value.to(torch.bfloat16).contiguous()
        for name, value in layer.state_dict().items()
        if name not in ("model.embed_tokens.weight", "lm_head.weight")
    }
    save_file(weights, str(committed / prepare.DRAFT_WEIGHTS))
    save_fc(committed, fc.to(torch.bfloat16))
    out = tmp_path / "assembled"
    out.mkdir()
    prepare.assemble_draft(committed, tmp_path / "target", out)
    assembled = load_file(out / prepare.DRAFT_WEIGHTS)
    embed = load_file(tmp_path / "target" / prepare.DRAFT_WEIGHTS)["model.embed_tokens.weight"]
    assert torch.equal(assembled["model.embed_tokens.weight"], embed)
    assert (out / "tokenizer.json").read_bytes() == (
        tmp_path / "target/tokenizer.json"
    ).read_bytes()
    lm, _ = load_session_lm(
        str(out), EngineOptions(device="cpu", precision=resolve_precision("float32", "cpu"))
    )
    assert isinstance(lm, FeatureLM)
    assert torch.equal(lm.engine.embed, embed)
    assert torch.equal(lm.fc.weight, fc.to(torch.bfloat16).float())
