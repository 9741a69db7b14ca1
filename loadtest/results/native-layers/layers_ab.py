"""In-process A/B: a forward's decoder layers driven from Python or in one native call.

    .venv/bin/python loadtest/results/native-layers/layers_ab.py [--reps 15] [--threads 2] \
        [--out loadtest/results/native-layers/layers_ab.json]

One LlamaEngine per model (the target, SmolLM2-135M, and the embedded draft; bf16), its
``native_layers`` set and unset in turn. Target shapes: a one-session decode step (1 x 1),
a 16-session one (16 x 1), a 16-block gamma = 4 verify (16 x 5), a 256-token prefill chunk
after 512 cached; draft shapes: 1 x 1 and 16 x 1. Each rep times both ways once per
shape, in alternating order, and they are compared by the median of their per-rep time
ratios, with quartiles (the machine drifts between fast and slow phases within minutes;
adjacent timings share the phase).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from asymspec.backends.embedded import EMBEDDED_DRAFT, EMBEDDED_TARGET
from asymspec.backends.hardware import machine_facts
from asymspec.backends.llama import LlamaEngine
from asymspec.backends.loading import load_causal_lm
from asymspec.prompts import humaneval_prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--iters", type=int, default=5, help="forwards per timing")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    engines = {}
    for role, name in (("target", EMBEDDED_TARGET), ("draft", EMBEDDED_DRAFT)):
        model, tok = load_causal_lm(name, "cpu", torch.bfloat16)
        engines[role] = LlamaEngine(model)
        assert engines[role].native_layers is not None, "the native layers loop did not load"
    loops = {role: engine.native_layers for role, engine in engines.items()}
    prompts = [tok(p).input_ids for p in humaneval_prompts("heldout")]
    long_ids = [t for p in prompts for t in p][: 512 + 256]

    def setup(role: str, name: str, b: int, n: int) -> tuple[str, list, dict]:
        engine, batch = engines[role], []
        for i in range(b):
            ids = long_ids if n > 16 else prompts[i % len(prompts)]
            sid = f"{name}{i}"
            engine.open(sid, ids[:-n])
            batch.append((sid, ids[-n:]))
        return role, batch, {s: engine.length(s) for s, _ in batch}

    shapes = {
        "target 1x1": setup("target", "o", 1, 1),
        "target 16x1": setup("target", "d", 16, 1),
        "target 16x5": setup("target", "v", 16, 5),
        "target prefill 256": setup("target", "p", 1, 256),
        "draft 1x1": setup("draft", "o", 1, 1),
        "draft 16x1": setup("draft", "d", 16, 1),
    }

    def timed(shape: str) -> float:
        role, batch, lengths = shapes[shape]
        engine = engines[role]
        keep = [1] * len(batch)
        started = time.perf_counter()
        for _ in range(args.iters):
            engine.forward_new(batch, keep_rows=keep)
            for s, length in lengths.items():
                engine.truncate(s, length)
        return (time.perf_counter() - started) / args.iters * 1e3

    ways = ["python", "native"]
    times: dict[str, dict[str, list[float]]] = {}
    with torch.inference_mode():
        for rep in range(args.reps):
            order = ways if rep % 2 == 0 else list(reversed(ways))
            for shape, (role, _, _) in shapes.items():
                for way in order:
                    engines[role].native_layers = loops[role] if way == "native" else None
                    timed(shape)  # warm
                    times.setdefault(shape, {}).setdefault(way, []).append(timed(shape))
    facts = {**machine_facts(), "torch_threads": args.threads, "dtype": "bfloat16"}
    rows, lines = {}, [f"machine: {json.dumps(facts)}"]
    for shape, per in times.items():
        ratios = sorted(p / n for p, n in zip(per["python"], per["native"], strict=True))
        row = {way: statistics.median(per[way]) for way in ways}
        row["python/native"] = statistics.median(ratios)
        row["python/native quartiles"] = [ratios[len(ratios) // 4], ratios[3 * len(ratios) // 4]]
        rows[shape] = row
        lines.append(
            f"{shape:20s} python {row['python']:.2f} ms  native {row['native']:.2f} ms  "
            f"python/native {row['python/native']:.3f} (quartiles "
            f"{row['python/native quartiles'][0]:.3f}-{row['python/native quartiles'][1]:.3f})"
        )
    print("\n".join(lines))
    if args.out:
        args.out.write_text(
            json.dumps({"machine": facts, "reps": args.reps, "rows": rows}, indent=2) + "\n"
        )


if __name__ == "__main__":
    main()
