"""SmolLM2-135M's linear layers alone (30 x qkv, o, gate_up, down, and the LM head; random
bf16 weights of the model's shapes): the native AMX kernel against oneDNN's packed bf16
products, interleaved, best of 6 after a warm-up, at each row count.

    .venv/bin/python loadtest/results/native-linear/products_cost.py --threads 2 \
        --rows 1 16 32 48 64 80 128 256 512
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from asymspec.backends.hardware import machine_facts
from asymspec.backends.native_linear import NativeLinear, pack_weight

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
LAYERS = 30
HEAD = (49152, 576)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 80, 256])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernel = NativeLinear.for_engine(torch.bfloat16, torch.device("cpu"), [576, 1536], True)
    assert kernel is not None
    generator = torch.Generator().manual_seed(0)
    layers = [(name, shape) for name, shape in SHAPES.items() for _ in range(LAYERS)]
    layers.append(("head", HEAD))
    weights = [(torch.randn(*s, generator=generator) * 0.02).to(torch.bfloat16) for _, s in layers]
    native = [pack_weight(w) for w in weights]
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w, 16) for w in weights]
    del weights
    weight_mb = sum(n * k * 2 for _, (n, k) in layers) / 1e6
    print(json.dumps({**machine_facts(), "weights_mb": round(weight_mb, 1)}))
    for rows in args.rows:
        inputs = {k: torch.randn(rows, k, generator=generator).to(torch.bfloat16) for k in (576, 1536)}
        padded = -(-rows // 16) * 16  # oneDNN's row buckets pad to 16 at least on AMX

        def run_native() -> None:
            for (_, (n, k)), w in zip(layers, native, strict=True):
                kernel(inputs[k], w, n, None)

        def run_onednn() -> None:
            for (_, (_, k)), w in zip(layers, onednn, strict=True):
                x = F.pad(inputs[k], (0, 0, 0, padded - rows))
                torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")

        best = {"native": float("inf"), "oneDNN": float("inf")}
        for repeat in range(7):
            for name, run in (("native", run_native), ("oneDNN", run_onednn)):
                start = time.perf_counter()
                run()
                if repeat:  # the first is warm-up
                    best[name] = min(best[name], time.perf_counter() - start)
        print(
            f"threads {args.threads} rows {rows:4d}: native {best['native'] * 1e3:6.1f} ms "
            f"({weight_mb / 1e3 / best['native']:4.1f} GB/s), oneDNN {best['oneDNN'] * 1e3:6.1f} ms "
            f"({weight_mb / 1e3 / best['oneDNN']:4.1f} GB/s)",
            flush=True,
        )


if __name__ == "__main__":
    main()
