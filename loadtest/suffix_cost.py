"""What the suffix drafter costs the edge per block where nothing repeats.

    .venv/bin/python -m loadtest.suffix_cost [--out loadtest/results/agent/suffix_cost.json]

Times ``SuffixDrafter.propose`` (the lookup each block makes before the draft model runs)
on contexts of random token ids (the embedded vocabulary's 49,152, so suffixes rarely
repeat) with the edge's store empty and full (its default 4 MiB: ~1M tokens), and on a
context that repeats (a block is proposed). Medians of repeated calls; one thread.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]

from asymspec_engine.hardware import machine_facts  # noqa: E402
from asymspec_engine.suffix import SuffixConfig, SuffixDrafter  # noqa: E402

VOCAB = 49_152
STORE_BYTES = 4 * 1024 * 1024


def median_us(drafter: SuffixDrafter, context: list[int], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        drafter.propose(context, 32)
        times.append(time.perf_counter() - started)
    return round(statistics.median(times) * 1e6, 1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument(
        "--out", type=Path, default=REPO / "loadtest/results/agent/suffix_cost.json"
    )
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    empty = SuffixDrafter(SuffixConfig(), STORE_BYTES)
    full = SuffixDrafter(SuffixConfig(), STORE_BYTES)
    while full.store.stored_bytes < STORE_BYTES - 4 * 300:  # outputs of 256 tokens
        full.remember(rng.integers(0, VOCAB, 256).tolist())
    rows = []
    for length in (256, 1024, 2048):
        context = rng.integers(0, VOCAB, length).tolist()
        repeating = context[: length // 2] + context[: length // 2]  # proposes a block
        rows.append(
            {
                "context_tokens": length,
                "no_repeat_empty_store_us": median_us(empty, context, args.repeats),
                "no_repeat_full_store_us": median_us(full, context, args.repeats),
                "repeating_full_store_us": median_us(full, repeating, args.repeats),
                "repeating_proposal_tokens": len(full.propose(repeating, 32).tokens),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    result = {
        "command": " ".join(sys.argv),
        "machine": machine_facts(),
        "store_tokens": int(full.store.buffer.size),
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
