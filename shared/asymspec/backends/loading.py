"""Load a causal LM and its tokenizer: the embedded pair or any Hugging Face checkpoint.

Names starting with ``embedded:`` resolve to the prepared model cache (``make models``);
anything else is a local folder or a hub id. The hub is offline by default, because this
project must run without network access; ``ASYMSPEC_ALLOW_DOWNLOAD=1`` lets transformers
download.
"""

from __future__ import annotations

import os

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from asymspec.backends.embedded import embedded_path, is_embedded

ALLOW_DOWNLOAD_ENV = "ASYMSPEC_ALLOW_DOWNLOAD"


def pick_device() -> str:
    """CUDA when a GPU is visible, else CPU."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def default_dtype(device: str | torch.device) -> torch.dtype:
    """bf16 on a GPU (half the memory, tensor cores); fp32 on a CPU, where bf16 is slow."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def resolve_model(name_or_path: str) -> str:
    """An embedded name -> its prepared folder (raises ModelNotPrepared); else unchanged."""
    return str(embedded_path(name_or_path)) if is_embedded(name_or_path) else name_or_path


def downloads_allowed() -> bool:
    return os.environ.get(ALLOW_DOWNLOAD_ENV, "") == "1"


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
        dtype=dtype or default_dtype(device),
        device_map=device,  # loads straight onto the device, without a CPU copy first
        local_files_only=local_only,
    )
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=local_only)
    return model.eval(), tokenizer
