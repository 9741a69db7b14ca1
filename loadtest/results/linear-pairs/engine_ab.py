"""In-process A/B of native_linear.c sources on the engine's own forwards.

    .venv/bin/python loadtest/results/linear-pairs/engine_ab.py \
        --variant before=/tmp/before.c --variant after=shared/asymspec/backends/native_linear.c \
        [--reps 15] [--burn 0.3] [--out loadtest/results/linear-pairs/engine_ab.json]

Each source is built as the engine builds its kernels and swapped into every linear layer
of one LlamaEngine (SmolLM2-135M, bf16, 2 threads). Shapes: a one-session decode step
(1 x 1), a 16-session one (16 x 1), a 16-block gamma = 4 verify (16 x 5), a 256-token
prefill chunk after 512 cached. Each rep times every variant once per shape, in
alternating order, and the variants are compared by the median of their per-rep time
ratios (the machine drifts between fast and slow phases within minutes; adjacent runs
share the phase). ``--burn`` adds a busy loop at that duty on one core (10 ms period)
while a second pass runs, as an edge and a chat client beside the cloud do.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from asymspec.backends.embedded import EMBEDDED_TARGET
from asymspec.backends.hardware import machine_facts
from asymspec.backends.llama import LlamaEngine
from asymspec.backends.loading import load_causal_lm
from asymspec.backends.native_build import NativeKernelSettings, build
from asymspec.backends.native_linear import NativeLinear
from asymspec.prompts import humaneval_prompts

BURNER = """import sys, time
duty = float(sys.argv[1])
while True:
    started = time.perf_counter()
    while time.perf_counter() - started < duty * 0.01:
        pass
    time.sleep((1 - duty) * 0.01)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--variant", action="append", required=True, help="label=source.c")
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--iters", type=int, default=5, help="forwards per timing")
    parser.add_argument("--burn", type=float, default=0.0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(2)
    model, tok = load_causal_lm(EMBEDDED_TARGET, "cpu", torch.bfloat16)
    engine = LlamaEngine(model)
    settings = NativeKernelSettings()
    kernels = {}
    for spec in args.variant:
        label, path = spec.split("=", 1)
        kernels[label] = NativeLinear(build(Path(path).resolve(), settings))
    linears = [
        linear
        for layer in engine.layers
        for linear in (layer.qkv, layer.o, layer.gate_up, layer.down)
    ] + [engine.head]
    prompts = [tok(p).input_ids for p in humaneval_prompts("heldout")]
    long_ids = [t for p in prompts for t in p][: 512 + 256]

    def setup(name: str, b: int, n: int) -> tuple[list, dict]:
        batch = []
        for i in range(b):
            ids = long_ids if n > 16 else prompts[i % len(prompts)]
            sid = f"{name}{i}"
            engine.open(sid, ids[:-n])
            batch.append((sid, ids[-n:]))
        return batch, {s: engine.length(s) for s, _ in batch}

    shapes = {
        "1x1": setup("o", 1, 1),
        "16x1": setup("d", 16, 1),
        "16x5": setup("v", 16, 5),
        "prefill 256": setup("p", 1, 256),
    }

    def timed(shape: str) -> float:
        batch, lengths = shapes[shape]
        keep = [1] * len(batch)
        started = time.perf_counter()
        for _ in range(args.iters):
            engine.forward_new(batch, keep_rows=keep)
            for s, length in lengths.items():
                engine.truncate(s, length)
        return (time.perf_counter() - started) / args.iters * 1e3

    passes = [False, True] if args.burn > 0 else [False]
    times: dict[str, dict[str, list[float]]] = {}
    with torch.inference_mode():
        for burn in passes:
            burner = (
                subprocess.Popen([sys.executable, "-c", BURNER, str(args.burn)]) if burn else None
            )
            try:
                for rep in range(args.reps):
                    order = list(kernels) if rep % 2 == 0 else list(reversed(kernels))
                    for shape in shapes:
                        for label in order:
                            for linear in linears:
                                linear.native = kernels[label]
                            timed(shape)  # warm
                            key = f"{shape}{' beside a burner' if burn else ''}"
                            times.setdefault(key, {}).setdefault(label, []).append(timed(shape))
            finally:
                if burner is not None:
                    burner.kill()
                    burner.wait()
    labels = list(kernels)
    base = labels[0]
    rows = {}
    lines = [f"machine: {json.dumps({**machine_facts(), 'torch_threads': 2, 'dtype': 'bfloat16'})}"]
    for key, per in times.items():
        row = {label: statistics.median(v) for label, v in per.items()}
        for label in labels[1:]:
            ratios = sorted(b / a for b, a in zip(per[base], per[label], strict=True))
            row[f"{base}/{label}"] = statistics.median(ratios)
            row[f"{base}/{label} quartiles"] = [
                ratios[len(ratios) // 4],
                ratios[3 * len(ratios) // 4],
            ]
        rows[key] = row
        lines.append(
            f"{key:28s} "
            + "  ".join(f"{label} {row[label]:.1f} ms" for label in labels)
            + "  "
            + "  ".join(
                f"{base}/{label} {row[f'{base}/{label}']:.3f} "
                f"(quartiles {row[f'{base}/{label} quartiles'][0]:.3f}-"
                f"{row[f'{base}/{label} quartiles'][1]:.3f})"
                for label in labels[1:]
            )
        )
    print("\n".join(lines))
    if args.out:
        args.out.write_text(
            json.dumps({"machine": machine_facts(), "reps": args.reps, "rows": rows}, indent=2)
        )


if __name__ == "__main__":
    main()
