"""Target forward time against the positions it scores (why the cloud saturates on a CPU).

    .venv/bin/python scripts/forward_cost.py [--target NAME_OR_PATH] [--threads 1]

One batched ``CachedLM.forward_new`` over B sessions (held-out HumanEval prompts as cached
prefixes, ~50-200 tokens) with n new tokens each: n = 1 is a decode step, n = γ + 1 = 5 a
verification of one γ = 4 block. Median of repeats, the cache rolled back after each. On a
GPU such forwards cost about the same for every n up to dozens of positions (the weights are
read once); on a CPU the cost grows with B·n, so verifying a block costs more than decoding
as many tokens as it yields unless acceptance is high.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from asymspec.backends.embedded import EMBEDDED_TARGET
from asymspec.backends.engine import CachedLM
from asymspec.backends.loading import load_causal_lm
from asymspec.prompts import humaneval_prompts

SHAPES = ((1, 1), (1, 5), (6, 1), (6, 5), (16, 1), (16, 5))  # (sessions B, new tokens n)


def median_forward_s(lm: CachedLM, prompts: list[list[int]], sessions: int, n: int) -> float:
    batch = []
    for i in range(sessions):
        ids = prompts[i % len(prompts)]
        session_id = f"b{sessions}n{n}s{i}"
        lm.open(session_id, ids[:-n])
        batch.append((session_id, ids[-n:]))
    lengths = {session_id: lm.length(session_id) for session_id, _ in batch}
    times = []
    for _ in range(6):
        started = time.perf_counter()
        lm.forward_new(batch)
        times.append(time.perf_counter() - started)
        for session_id, length in lengths.items():
            lm.truncate(session_id, length)
    for session_id, _ in batch:
        lm.close(session_id)
    return statistics.median(times[1:])  # the first is a warm-up


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default=EMBEDDED_TARGET)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_causal_lm(args.target, "cpu")
    lm = CachedLM(model, pad_token_id=int(tokenizer.pad_token_id or 0))
    prompts = [tokenizer(p).input_ids for p in humaneval_prompts("heldout")]
    for sessions, n in SHAPES:
        seconds = median_forward_s(lm, prompts, sessions, n)
        print(
            f"B={sessions:2d} x {n} new tokens: {1e3 * seconds:7.1f} ms per forward, "
            f"{1e3 * seconds / (sessions * n):5.1f} ms per position",
            flush=True,
        )


if __name__ == "__main__":
    main()
