"""Load a causal LM and its tokenizer: the embedded pair or any Hugging Face checkpoint.

Names starting with ``embedded:`` resolve to the prepared model cache (``make models``);
anything else is a local folder or a hub id. The hub is offline by default, because this
project must run without network access; ``ASYMSPEC_ALLOW_DOWNLOAD=1`` lets transformers
download.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from asymspec_engine.embedded import embedded_path, is_embedded
from asymspec_engine.engine import CachedLM, SessionLM
from asymspec_engine.feature_draft import FeatureLM, is_feature_draft, load_fc
from asymspec_engine.hardware import Precision, pick_device, resolve_dtype, resolve_precision
from asymspec_engine.head_vocab import read_head_vocab
from asymspec_engine.llama import LlamaEngine, unsupported_reason
from asymspec_engine.store_settings import ModelStoreSettings

log = logging.getLogger("asymspec.engine")


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


def session_lm(
    model: PreTrainedModel, pad_token_id: int = 0, fp16_weights: bool = False
) -> SessionLM:
    """The engine for ``model``: ``LlamaEngine`` for Llama-family decoders (with float16
    weights if asked), else the transformers-backed ``CachedLM``. The choice is logged."""
    reason = unsupported_reason(model)
    if reason is None:
        return LlamaEngine(model, fp16_weights)  # no padding, so no pad token
    log.info("CachedLM (transformers) for %s: %s", type(model).__name__, reason)
    if fp16_weights:
        log.warning("CachedLM keeps the model's own weights: float16 weights not applied")
    return CachedLM(model, pad_token_id=pad_token_id)


def restrict_draft_head(lm: SessionLM | FeatureLM, name_or_path: str) -> bool:
    """Restrict a draft's LM head to the tokens its folder's head_vocab.json lists (q = 0
    elsewhere, which is exact); False when there is no such file or the engine cannot."""
    folder = Path(resolve_model(name_or_path))
    head = read_head_vocab(folder) if folder.is_dir() else None
    if head is None:
        return False
    if isinstance(lm, FeatureLM):
        lm = lm.engine
    if not isinstance(lm, LlamaEngine):
        log.warning("%s: head_vocab.json needs the LlamaEngine; whole head kept", name_or_path)
        return False
    lm.restrict_head(head)
    return True


def load_session_lm(
    name_or_path: str, device: str | None = None, precision: Precision | None = None
) -> tuple[SessionLM | FeatureLM, PreTrainedTokenizerBase]:
    """``load_causal_lm`` wrapped in its engine (``session_lm``); ``precision`` defaults to
    the device's ``auto``. A feature draft's folder (``feature_fc.safetensors`` beside a
    one-layer Llama) gives a ``FeatureLM``."""
    device = device or pick_device()
    precision = precision or resolve_precision("auto", device)
    model, tokenizer = load_causal_lm(name_or_path, device, precision.dtype)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    lm = session_lm(model, int(pad), precision.fp16_weights)
    folder = Path(resolve_model(name_or_path))
    if folder.is_dir() and is_feature_draft(folder):
        if not isinstance(lm, LlamaEngine):
            raise ValueError(f"{name_or_path}: a feature draft must be a Llama-family layer")
        log.info("%s is a feature draft: it drafts from the target's hidden states", name_or_path)
        return FeatureLM(lm, load_fc(folder).to(device)), tokenizer
    return lm, tokenizer
