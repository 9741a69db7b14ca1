"""What a benchmark's results say each service ran on."""

from __future__ import annotations

from pathlib import Path

import pytest

from asymspec_engine.gguf_export import export_llama
from asymspec_engine.llamacpp import ENGINE_GGUF, llama_cpp_available
from loadtest.bench.config import ModelPair
from loadtest.bench.runner import engines
from loadtest.tiny_models import save_tiny_pair


def test_the_results_name_the_engine_each_service_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target, draft = save_tiny_pair(tmp_path)
    pair = ModelPair("tiny", str(target), str(draft))
    assert engines(pair) == {"cloud": "torch", "edge": "torch"}  # no GGUF file
    if not llama_cpp_available():
        pytest.skip("llama.cpp's bindings are not installed")
    export_llama(target, target / ENGINE_GGUF)
    assert engines(pair) == {"cloud": f"llama.cpp ({ENGINE_GGUF})", "edge": "torch"}
    monkeypatch.setenv("ASYMSPEC_CLOUD_ENGINE", "torch")
    assert engines(pair) == {"cloud": "torch", "edge": "torch"}
