"""The torch engine on a GPU: correctness against the float32 CPU reference, exact
speculative sampling on the device's rows, and the cost of a verify against a decode step.

    .venv/bin/python -m loadtest.gpu_check [--device cuda] [--out loadtest/results/gpu-check]

1. **engine**: a tiny random Llama on the device (bf16) against the same model in float32 on
   the CPU: ragged batches, rollback and the kept rows (within bf16's rounding).
2. **sampling**: blocks of γ = 3 drafted from the device's q rows and verified against its p
   rows by the project's own acceptance and recovery code, 20,000 times; the first token's
   counts against p (χ² p-value; exact speculative sampling must follow p).
3. **cost**: a ~1B-shaped random-weight Llama in bf16 (16 layers, hidden 2,048, 32 heads,
   8 KV heads): a 16-session decode step against a 16-block γ = 4 verify, both over
   512-token prefixes (medians of 20, after warm-up).

``--device cpu --small`` runs every step on the CPU with a small model (what the test suite
does, so the script cannot rot where no GPU is lent). Results: ``results.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import torch
from scipy import stats
from transformers import LlamaConfig, LlamaForCausalLM

from asymspec.sampling import accept_token, residual, sample
from asymspec_engine.hardware import machine_facts
from asymspec_engine.llama import LlamaEngine

REPO = Path(__file__).resolve().parents[1]


def llama(hidden: int, layers: int, heads: int, kv_heads: int, vocab: int) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=4096,
        initializer_range=0.2 if hidden < 256 else 0.02,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def check_engine(device: str) -> dict[str, Any]:
    model = llama(64, 2, 4, 2, 256)
    reference = LlamaEngine(model)
    # transformers types PreTrainedModel.to as a bare wrapper that mypy cannot call
    moved = llama(64, 2, 4, 2, 256).to(device=device, dtype=torch.bfloat16)  # type: ignore[call-arg]
    on_device = LlamaEngine(moved)
    prompts = {"a": list(range(10, 17)), "b": list(range(30, 60)), "c": [5]}
    for session, prompt in prompts.items():
        reference.open(session, prompt)
        on_device.open(session, prompt)
    batch = [("a", [1, 2, 3, 4, 5]), ("b", [9]), ("c", [7, 8])]
    worst = 0.0
    for _ in range(2):  # the second time after a rollback
        want = reference.forward_new(batch, keep_rows=[5, 1, 2])
        got = on_device.forward_new(batch, keep_rows=[5, 1, 2])
        for w, g in zip(want, got, strict=True):
            tv = 0.5 * (torch.softmax(w, -1) - torch.softmax(g.cpu(), -1)).abs().sum(-1)
            worst = max(worst, float(tv.max()))
        for session, prompt in prompts.items():
            reference.truncate(session, len(prompt))
            on_device.truncate(session, len(prompt))
    return {"max_total_variation_vs_cpu_float32": round(worst, 4), "ok": worst < 0.05}


def check_sampling(device: str, draws: int = 20000) -> dict[str, Any]:
    """Speculative sampling of one position on the device's rows: the first token is the
    accepted draft or the recovered token; its law must be p."""
    generator = torch.Generator(device="cpu").manual_seed(1)
    p = torch.softmax(torch.randn(16, generator=generator).to(device) * 2, -1).double().cpu()
    q = torch.softmax(torch.randn(16, generator=generator).to(device) * 2, -1).double().cpu()
    p_np, q_np = p.numpy(), q.numpy()
    rng = np.random.default_rng(2)
    counts: Counter[int] = Counter()
    for _ in range(draws):
        x = sample(q_np, float(rng.random()))
        if accept_token(float(p_np[x]), float(q_np[x]), float(rng.random())):
            counts[x] += 1
        else:
            counts[sample(residual(p_np, q_np), float(rng.random()))] += 1
    observed = np.array([counts.get(i, 0) for i in range(16)])
    expected = p_np / p_np.sum() * observed.sum()
    pvalue = float(stats.chisquare(observed, expected).pvalue)
    return {"draws": draws, "chi_square_pvalue": round(pvalue, 4), "ok": pvalue > 0.001}


def check_cost(device: str, small: bool) -> dict[str, Any]:
    shape = (128, 2, 4, 2, 1024) if small else (2048, 16, 32, 8, 32000)
    model = llama(*shape).to(device=device, dtype=torch.bfloat16)  # type: ignore[call-arg]
    engine = LlamaEngine(model)
    prefix = 64 if small else 512
    for i in range(16):
        engine.open(f"s{i}", [(7 * i + j) % 1000 + 1 for j in range(prefix)])

    def median_s(new: int) -> float:
        batch = [(f"s{i}", [3] * new) for i in range(16)]
        seconds = []
        for _ in range(25):
            if device == "cuda":
                torch.cuda.synchronize()
            started = time.perf_counter()
            engine.forward_new(batch, keep_rows=[new] * 16)
            if device == "cuda":
                torch.cuda.synchronize()
            seconds.append(time.perf_counter() - started)
            for i in range(16):
                engine.truncate(f"s{i}", prefix)
        return statistics.median(seconds[5:])

    decode, verify = median_s(1), median_s(5)
    return {
        "model": dict(zip(("hidden", "layers", "heads", "kv_heads", "vocab"), shape, strict=True)),
        "decode_16x1_ms": round(1e3 * decode, 2),
        "verify_16x5_ms": round(1e3 * verify, 2),
        "verify_over_decode": round(verify / decode, 3),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--small", action="store_true", help="a small cost model (CPU runs)")
    parser.add_argument("--out", type=Path, default=REPO / "loadtest/results/gpu-check")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device visible to torch (run with --device cpu --small to try it)")
    device_name = (
        torch.cuda.get_device_name() if args.device == "cuda" else machine_facts()["cpu_model"]
    )
    result: dict[str, Any] = {
        "command": f".venv/bin/python -m loadtest.gpu_check --device {args.device}",
        "device": device_name,
        "torch": torch.__version__,
        "engine": check_engine(args.device),
        "sampling": check_sampling(args.device),
        "cost": check_cost(args.device, args.small),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return 0 if result["engine"]["ok"] and result["sampling"]["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
