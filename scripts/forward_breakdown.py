"""Where a LlamaEngine forward's time goes, by op family: how much torch.compile could win.

    .venv/bin/python scripts/forward_breakdown.py [--threads 1] [--dtype bfloat16]
        [--shape 16x1 --shape 16x5] [--out loadtest/results/forward_breakdown]

torch.compile on CPU fuses elementwise ops (norms, activations, rotary, adds) and removes
Python dispatch between them; it does not make oneDNN's matmuls or the per-session SDPA
calls faster. So the elementwise share (plus the dispatch gaps around it) bounds what it
can save. One ``forward_new`` over B sessions with n new tokens (held-out HumanEval
prefixes), profiled with torch.profiler after warm-up: self CPU time per op family, and
the rest of the wall time (Python and dispatch between ops). Writes a .json and a .txt
with the CPU model and flags, torch threads and dtype.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from asymspec_engine.embedded import EMBEDDED_TARGET
from asymspec_engine.hardware import machine_facts
from asymspec_engine.llama import LlamaEngine
from asymspec_engine.loading import load_causal_lm
from asymspec.prompts import humaneval_prompts

FAMILIES = (  # (family, op-name fragments), first match wins
    ("matmul", ("linear", "mm", "matmul", "addmm")),
    ("attention", ("scaled_dot_product", "flash_attention", "_efficient_attention")),
    ("kv-copy", ("copy_", "index_put", "index_copy", "slice_scatter", "to", "clone")),
    ("elementwise", ("rms_norm", "silu", "mul", "add", "neg", "cat", "sub", "div", "pow",
                     "rsqrt", "mean", "chunk", "split", "where", "masked_fill")),
)  # fmt: skip


def family(op: str) -> str:
    name = op.removeprefix("aten::").removeprefix("mkldnn::")
    for label, fragments in FAMILIES:
        if any(fragment in name for fragment in fragments):
            return label
    return "other"


def breakdown(engine: LlamaEngine, prompts: list[list[int]], b: int, n: int) -> dict[str, float]:
    batch = []
    for i in range(b):
        ids = prompts[i % len(prompts)]
        engine.open(f"s{i}", ids[:-n])
        batch.append((f"s{i}", ids[-n:]))
    lengths = {s: engine.length(s) for s, _ in batch}

    def once() -> None:
        engine.forward_new(batch, keep_rows=[n] * b)
        for s, length in lengths.items():
            engine.truncate(s, length)

    with torch.inference_mode():
        for _ in range(3):
            once()  # warm-up: oneDNN primitives, allocator
        started = time.perf_counter()
        once()
        wall_ms = (time.perf_counter() - started) * 1e3
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            once()
    per_family: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        per_family[family(event.key)] += event.self_cpu_time_total / 1e3  # µs -> ms
    for s in lengths:
        engine.close(s)
    ops_ms = sum(per_family.values())
    return {"wall_ms": wall_ms, **dict(per_family), "between_ops_ms": max(0.0, wall_ms - ops_ms)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--target", default=EMBEDDED_TARGET)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--shape", action="append", default=None, help="BxN, e.g. 16x1")
    parser.add_argument("--out", type=Path, default=Path("loadtest/results/forward_breakdown"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    model, tokenizer = load_causal_lm(args.target, "cpu", dtype)
    engine = LlamaEngine(model)
    prompts = [tokenizer(p).input_ids for p in humaneval_prompts("heldout")]
    shapes = [tuple(int(x) for x in s.split("x")) for s in (args.shape or ["1x1", "16x1", "16x5"])]
    rows = {f"{b}x{n}": breakdown(engine, prompts, b, n) for b, n in shapes}
    facts = {**machine_facts(), "torch_threads": torch.get_num_threads(), "dtype": args.dtype}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "forward_breakdown.json").write_text(
        json.dumps({"machine": facts, "rows": rows}, indent=2)
    )
    columns = [
        "wall_ms",
        "matmul",
        "attention",
        "kv-copy",
        "elementwise",
        "other",
        "between_ops_ms",
    ]
    lines = [f"machine: {json.dumps(facts)}", "shape   " + "  ".join(f"{c:>13s}" for c in columns)]
    for shape, row in rows.items():
        lines.append(f"{shape:7s} " + "  ".join(f"{row.get(c, 0.0):13.1f}" for c in columns))
    (args.out / "forward_breakdown.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
