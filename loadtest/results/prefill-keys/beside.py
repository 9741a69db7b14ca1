"""What a long prompt's chunk costs a one-row decode step beside it, in-process.

    .venv/bin/python loadtest/results/prefill-keys/beside.py [--prefix 1000] [--reps 12] \
        [--out loadtest/results/prefill-keys/beside.txt]

One LlamaEngine (SmolLM2-135M, bf16, 2 threads): a short session (60 tokens cached) takes a
one-row step alone, then beside k rows of a long prompt with ``--prefix`` tokens cached, for
k in 1 .. 64. Each rep times every k in alternating order; the ratios to the step alone are
medians of per-rep ratios with quartiles (the machine drifts between phases within minutes).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from asymspec.backends.embedded import EMBEDDED_TARGET
from asymspec.backends.hardware import machine_facts
from asymspec.backends.llama import LlamaEngine
from asymspec.backends.loading import load_causal_lm
from asymspec.prompts import humaneval_prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--prefix", type=int, default=1000)
    parser.add_argument("--reps", type=int, default=12)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(2)
    model, tok = load_causal_lm(EMBEDDED_TARGET, "cpu", torch.bfloat16)
    engine = LlamaEngine(model)
    ids = [t for p in humaneval_prompts("heldout") for t in tok(p).input_ids]
    assert len(ids) >= args.prefix + 64, "not enough held-out prompt tokens"
    engine.open("short", ids[:60])
    engine.open("long", ids[: args.prefix])
    ks = [0, 1, 4, 8, 15, 16, 17, 24, 32, 64]
    times: dict[int, list[float]] = {k: [] for k in ks}

    def forward(k: int) -> None:
        batch = [("short", ids[60:61])]
        if k:
            batch.append(("long", ids[args.prefix : args.prefix + k]))
        engine.forward_new(batch, keep_rows=[1] * len(batch))
        engine.truncate("short", 60)
        engine.truncate("long", args.prefix)

    with torch.inference_mode():
        for rep in range(args.reps):
            for k in ks if rep % 2 == 0 else ks[::-1]:
                forward(k)  # warm
                started = time.perf_counter()
                for _ in range(5):
                    forward(k)
                times[k].append((time.perf_counter() - started) / 5 * 1e3)
    facts = {**machine_facts(), "torch_threads": 2, "dtype": "bfloat16", "prefix": args.prefix}
    lines = [f"machine: {json.dumps(facts)}"]
    for k in ks:
        ratios = sorted(a / b for a, b in zip(times[k], times[0], strict=True))
        q1, q3 = ratios[len(ratios) // 4], ratios[3 * len(ratios) // 4]
        lines.append(
            f"step beside {k:2d} prompt rows: {statistics.median(times[k]):6.2f} ms, "
            f"{statistics.median(ratios):.3f} x alone (quartiles {q1:.3f}-{q3:.3f})"
        )
    print("\n".join(lines))
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
