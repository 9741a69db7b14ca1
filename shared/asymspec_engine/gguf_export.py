"""GGUF files for the llama.cpp engine: a Hugging Face Llama checkpoint written as GGUF,
and llama.cpp's own quantiser.

The embedded target already ships as GGUF; the draft (and any small Llama-family
checkpoint, the tests' tiny models among them) is written here with the ``gguf`` package,
the tensor layout llama.cpp's ``convert_hf_to_gguf.py`` gives a Llama: the same names,
query and key rows permuted from the Hugging Face rotary layout (halves) to llama.cpp's
(interleaved pairs), the tokenizer's vocabulary and merges as a byte-level BPE. llama.cpp
never tokenizes here (the services use the Hugging Face tokenizer), so the tokenizer
metadata only has to load.
"""

from __future__ import annotations

import ctypes
import json
from pathlib import Path

import numpy as np
import torch

QUANTS = {"f32": 0, "f16": 1, "q4_0": 2, "q8_0": 7}  # llama.cpp's LLAMA_FTYPE_* values
_TOKEN_NORMAL, _TOKEN_CONTROL, _TOKEN_UNUSED = 1, 3, 5


def quantize(source: Path, out: Path, quant: str, threads: int = 2) -> None:
    """``out``: ``source`` quantised to ``quant`` by llama.cpp (a quantised source is
    de-quantised first: the embedded target's Q4_1 weights go to Q8_0 nearly unchanged)."""
    from asymspec_engine.llamacpp import bindings

    lib = bindings()
    params = lib.llama_model_quantize_default_params()
    params.ftype = QUANTS[quant]
    params.allow_requantize = True
    params.nthread = threads
    status = lib.llama_model_quantize(str(source).encode(), str(out).encode(), ctypes.byref(params))
    if status != 0:
        raise RuntimeError(f"llama.cpp could not quantise {source} to {quant} ({status})")


def _permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """Rotary rows from Hugging Face's layout (first half, second half) to llama.cpp's
    (interleaved pairs), per head; ``convert_hf_to_gguf.py``'s ``LlamaModel.permute``."""
    rows = weight.shape[0]
    return (
        weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _rope_theta(config: dict[str, object]) -> float:
    """transformers 5 keeps the rotary base in ``rope_parameters``; older configs at the top."""
    rope = config.get("rope_parameters") or {}
    assert isinstance(rope, dict)
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"rotary scaling {rope.get('rope_type')!r} is not written to GGUF")
    theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
    assert isinstance(theta, int | float)
    return float(theta)


def _tokenizer_fields(folder: Path, vocab_size: int) -> tuple[list[str], list[int], list[str]]:
    """(tokens by id, their types, merges) from the folder's ``tokenizer.json``; ids the
    tokenizer leaves unused up to ``vocab_size`` get placeholder tokens."""
    spec = json.loads((folder / "tokenizer.json").read_text())
    model = spec["model"]
    if model.get("type") != "BPE":
        raise ValueError(f"{folder}: only byte-level BPE tokenizers are written to GGUF")
    by_id: dict[int, str] = {int(i): token for token, i in model["vocab"].items()}
    special = {int(t["id"]) for t in spec.get("added_tokens", []) if t.get("special")}
    for added in spec.get("added_tokens", []):
        by_id[int(added["id"])] = added["content"]
    tokens, types = [], []
    for i in range(vocab_size):
        if i in by_id:
            tokens.append(by_id[i])
            types.append(_TOKEN_CONTROL if i in special else _TOKEN_NORMAL)
        else:
            tokens.append(f"[PAD{i}]")
            types.append(_TOKEN_UNUSED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    return tokens, types, merges


def export_llama(folder: Path, out: Path) -> None:
    """Write the Llama-family checkpoint in ``folder`` (config, safetensors, tokenizer) as
    a float32 GGUF file ``out``."""
    import gguf
    from safetensors.torch import load_file

    config = json.loads((folder / "config.json").read_text())
    if config.get("model_type") != "llama":
        raise ValueError(f"{folder}: only Llama checkpoints are written to GGUF")
    weights: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("*.safetensors")):
        weights.update(load_file(path))
    heads, kv_heads = int(config["num_attention_heads"]), int(config["num_key_value_heads"])
    hidden = int(config["hidden_size"])
    head_dim = int(config.get("head_dim") or hidden // heads)
    vocab_size = int(config["vocab_size"])

    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_name(folder.name)
    writer.add_context_length(int(config["max_position_embeddings"]))
    writer.add_embedding_length(hidden)
    writer.add_block_count(int(config["num_hidden_layers"]))
    writer.add_feed_forward_length(int(config["intermediate_size"]))
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(_rope_theta(config))
    writer.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
    writer.add_vocab_size(vocab_size)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    tokens, types, merges = _tokenizer_fields(folder, vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    for key, name in (("bos_token_id", "bos"), ("eos_token_id", "eos"), ("pad_token_id", "pad")):
        value = config.get(key)
        if isinstance(value, list):
            value = value[0] if value else None
        if value is not None:
            getattr(writer, f"add_{name}_token_id")(int(value))

    def add(name: str, tensor: torch.Tensor) -> None:
        writer.add_tensor(name, tensor.to(torch.float32).numpy())

    add("token_embd.weight", weights["model.embed_tokens.weight"])
    add("output_norm.weight", weights["model.norm.weight"])
    if "lm_head.weight" in weights and not config.get("tie_word_embeddings", False):
        add("output.weight", weights["lm_head.weight"])
    for i in range(int(config["num_hidden_layers"])):
        hf, blk = f"model.layers.{i}.", f"blk.{i}."
        add(blk + "attn_norm.weight", weights[hf + "input_layernorm.weight"])
        q = weights[hf + "self_attn.q_proj.weight"].float().numpy()
        k = weights[hf + "self_attn.k_proj.weight"].float().numpy()
        writer.add_tensor(blk + "attn_q.weight", _permute(q, heads))
        writer.add_tensor(blk + "attn_k.weight", _permute(k, kv_heads))
        add(blk + "attn_v.weight", weights[hf + "self_attn.v_proj.weight"])
        add(blk + "attn_output.weight", weights[hf + "self_attn.o_proj.weight"])
        add(blk + "ffn_norm.weight", weights[hf + "post_attention_layernorm.weight"])
        add(blk + "ffn_gate.weight", weights[hf + "mlp.gate_proj.weight"])
        add(blk + "ffn_up.weight", weights[hf + "mlp.up_proj.weight"])
        add(blk + "ffn_down.weight", weights[hf + "mlp.down_proj.weight"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
