"""Load a causal LM and its tokenizer: the embedded pair or any Hugging Face checkpoint.

Names starting with ``embedded:`` resolve to the prepared model cache (``make models``);
anything else is a local folder or a hub id. The hub is offline by default, because this
project must run without network access; ``ASYMSPEC_ALLOW_DOWNLOAD=1`` lets transformers
download.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from asymspec_engine.embedded import embedded_path, is_embedded
from asymspec_engine.engine import CachedLM, SessionLM
from asymspec_engine.feature_draft import FeatureLM, is_feature_draft, load_fc
from asymspec_engine.hardware import Precision, pick_device, resolve_dtype, resolve_precision
from asymspec_engine.head_vocab import read_head_vocab
from asymspec_engine.llama import LlamaEngine, unsupported_reason
from asymspec_engine.llamacpp import ENGINE_GGUF, LlamaCppEngine, llama_cpp_available
from asymspec_engine.store_settings import ModelStoreSettings

log = logging.getLogger("asymspec.engine")

EngineName = Literal["auto", "llama.cpp", "torch"]


def resolve_model(name_or_path: str) -> str:
    """An embedded name -> its prepared folder (raises ModelNotPrepared); else unchanged."""
    return str(embedded_path(name_or_path)) if is_embedded(name_or_path) else name_or_path


def downloads_allowed() -> bool:
    return ModelStoreSettings().allow_download


def load_causal_lm(
    name_or_path: str, device: str | None = None, dtype: torch.dtype | None = None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The model (on ``device``, in eval mode) and its tokenizer.

    Callers run forwards under ``torch.inference_mode()`` (``CachedLM`` does).
    """
    device = device or pick_device()
    path = resolve_model(name_or_path)
    local_only = not downloads_allowed()
    model = AutoModelForCausalLM.from_pretrained(
        path,
        dtype=dtype or resolve_dtype("auto", device),
        device_map=device,  # loads straight onto the device, without a CPU copy first
        local_files_only=local_only,
    )
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=local_only)
    return model.eval(), tokenizer


def session_lm(model: PreTrainedModel, pad_token_id: int = 0) -> SessionLM:
    """The torch engine for ``model``: ``LlamaEngine`` for Llama-family decoders, else the
    transformers-backed ``CachedLM``. The choice is logged."""
    reason = unsupported_reason(model)
    if reason is None:
        return LlamaEngine(model)  # no padding, so no pad token
    log.info("CachedLM (transformers) for %s: %s", type(model).__name__, reason)
    return CachedLM(model, pad_token_id=pad_token_id)


def restrict_draft_head(lm: SessionLM | FeatureLM, name_or_path: str) -> bool:
    """Restrict a draft's LM head to the tokens its folder's head_vocab.json lists (q = 0
    elsewhere, which is exact); False when there is no such file or the engine cannot."""
    folder = Path(resolve_model(name_or_path))
    head = read_head_vocab(folder) if folder.is_dir() else None
    if head is None:
        return False
    engine = lm.engine if isinstance(lm, FeatureLM) else lm
    if not engine.restricts_head:
        log.info("%s: the %s engine scores the whole vocabulary", name_or_path, engine.name)
        return False
    engine.restrict_head(head)
    return True


def find_gguf(name_or_path: str) -> Path | None:
    """The GGUF file the llama.cpp engine loads for a model: the path itself when it is a
    ``.gguf`` file, else the prepared ``model.q8_0.gguf`` (or the one ``.gguf`` file) in
    its folder; None when there is none."""
    path = Path(resolve_model(name_or_path)).expanduser()
    if path.suffix == ".gguf":
        return path if path.is_file() else None
    if not path.is_dir():
        return None
    if (path / ENGINE_GGUF).is_file():
        return path / ENGINE_GGUF
    found = sorted(path.glob("*.gguf"))
    return found[0] if len(found) == 1 else None


@dataclass(frozen=True)
class EngineChoice:
    """Which engine runs a model, and why (logged at start-up)."""

    name: EngineName
    reason: str
    gguf: Path | None = None


def choose_engine(requested: EngineName | str, name_or_path: str, device: str) -> EngineChoice:
    """``auto``: llama.cpp on a CPU for a model with a GGUF file (the embedded pair has
    one), the torch engine on CUDA, for a feature draft, or where llama.cpp is missing."""
    gguf = find_gguf(name_or_path)
    folder = Path(resolve_model(name_or_path))
    feature = folder.is_dir() and is_feature_draft(folder)
    if requested == "torch":
        return EngineChoice("torch", "asked for")
    if requested == "llama.cpp":
        if feature:
            raise ValueError(f"{name_or_path}: a feature draft needs the torch engine")
        if not llama_cpp_available():
            raise ValueError("engine llama.cpp: its bindings are not installed (make install)")
        if gguf is None:
            raise ValueError(f"engine llama.cpp: no GGUF file for {name_or_path}")
        return EngineChoice("llama.cpp", "asked for", gguf)
    if requested != "auto":
        raise ValueError(f"engine must be auto, llama.cpp or torch, got {requested!r}")
    if torch.device(device).type != "cpu":
        return EngineChoice("torch", f"auto: a {device} device runs the torch engine")
    if feature:
        return EngineChoice("torch", "auto: a feature draft drafts from hidden states (torch)")
    if not llama_cpp_available():
        return EngineChoice("torch", "auto: llama.cpp's bindings are not installed")
    if gguf is None:
        return EngineChoice("torch", f"auto: no GGUF file for {name_or_path}")
    return EngineChoice("llama.cpp", "auto: a CPU, and the model has a GGUF file", gguf)


@dataclass(frozen=True)
class EngineOptions:
    """How to run a model: the engine (``auto``, ``llama.cpp``, ``torch``), the device and
    precision (torch), threads and session capacity (llama.cpp)."""

    engine: EngineName | str = "auto"
    device: str | None = None
    precision: Precision | None = None
    threads: int = 1
    max_sessions: int = 16
    session_tokens: int = 4096
    prefix_reuse: bool = True  # llama.cpp: keep closed sessions' streams (adopt_prefix)
    prefix_cache_bytes: int = 0  # llama.cpp: host memory for closed sessions' cells


def load_session_lm(
    name_or_path: str, options: EngineOptions | None = None
) -> tuple[SessionLM | FeatureLM, PreTrainedTokenizerBase]:
    """The engine for a model and its tokenizer, as ``options`` say (the choice and its
    reason are logged). A feature draft's folder (``feature_fc.safetensors`` beside a
    one-layer Llama) gives a ``FeatureLM`` on the torch engine."""
    options = options or EngineOptions()
    device = options.device or pick_device()
    choice = choose_engine(options.engine, name_or_path, device)
    log.info("%s: the %s engine (%s)", name_or_path, choice.name, choice.reason)
    if choice.gguf is not None:
        lm = LlamaCppEngine(
            choice.gguf,
            threads=options.threads,
            max_sessions=options.max_sessions,
            session_tokens=options.session_tokens,
            prefix_reuse=options.prefix_reuse,
            prefix_cache_bytes=options.prefix_cache_bytes,
        )
        return lm, load_tokenizer(name_or_path, choice.gguf)
    precision = options.precision or resolve_precision("auto", device)
    model, tokenizer = load_causal_lm(name_or_path, device, precision.dtype)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    torch_lm = session_lm(model, int(pad))
    folder = Path(resolve_model(name_or_path))
    if folder.is_dir() and is_feature_draft(folder):
        if not isinstance(torch_lm, LlamaEngine):
            raise ValueError(f"{name_or_path}: a feature draft must be a Llama-family layer")
        log.info("%s is a feature draft: it drafts from the target's hidden states", name_or_path)
        return FeatureLM(torch_lm, load_fc(folder).to(device)), tokenizer
    return torch_lm, tokenizer


def load_tokenizer(name_or_path: str, gguf: Path) -> PreTrainedTokenizerBase:
    """The Hugging Face tokenizer of a model folder; for a bare GGUF file, the one
    transformers builds from the file's own tokenizer metadata."""
    folder = Path(resolve_model(name_or_path)).expanduser()
    local_only = not downloads_allowed()
    if folder.is_dir():
        return AutoTokenizer.from_pretrained(folder, local_files_only=local_only)
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
