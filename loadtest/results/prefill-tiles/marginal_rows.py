"""What prompt rows add to a one-session decode step (the cloud's shared prefill chunks).

    .venv/bin/python loadtest/results/prefill-tiles/marginal_rows.py [--threads 2]

One LlamaEngine forward of a 1-row decode step (a 40-token session) beside r rows of a
1,000-token prompt's prefill, r in 0..63, the sizes interleaved 15 times; prints the
median and best milliseconds per r, with the machine (CPU model and flags, torch threads,
dtype). What ``PrefillBudget`` models beside work: each prompt row at the fitted slope,
plus each row the engine's padded frame (16-row tiles on AMX) grows by.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from asymspec.backends.embedded import EMBEDDED_TARGET
from asymspec.backends.hardware import machine_facts
from asymspec.backends.llama import LlamaEngine
from asymspec.backends.loading import load_causal_lm


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, _ = load_causal_lm(EMBEDDED_TARGET, dtype=torch.bfloat16)
    engine = LlamaEngine(model)
    engine.open("short", list(range(100, 140)))
    engine.open("long", list(range(200, 1200)))
    short_len, long_len = engine.length("short"), engine.length("long")

    def forward(rows: int) -> float:
        batch = [("short", [7])] + ([("long", list(range(300, 300 + rows)))] if rows else [])
        started = time.perf_counter()
        engine.forward_new(batch, keep_rows=[1] + ([0] if rows else []))
        elapsed = time.perf_counter() - started
        engine.truncate("short", short_len)
        engine.truncate("long", long_len)
        return elapsed

    sizes = [0, 7, 15, 16, 23, 31, 47, 63]
    times: dict[int, list[float]] = {r: [] for r in sizes}
    for r in sizes:
        forward(r)  # warm-up: oneDNN builds a primitive per row bucket
    for _ in range(15):
        for r in sizes:
            times[r].append(forward(r))
    print(json.dumps({**machine_facts(), "dtype": "bfloat16", "layout": engine.layout.value}))
    alone = statistics.median(times[0])
    for r in sizes:
        median = statistics.median(times[r])
        print(
            f"prompt rows {r:2d} (frame {engine.padded_rows(1 + r):2d} rows): "
            f"median {median * 1e3:5.1f} ms (+{(median - alone) * 1e3:4.1f}), "
            f"best {min(times[r]) * 1e3:5.1f} ms"
        )


if __name__ == "__main__":
    main()
