"""What it costs to run a model's forwards on a thread other than the one that loaded it.

    .venv/bin/python scripts/model_thread_cost.py [--threads 2] [--out DIR]

torch's CPU kernels run on OpenMP (libgomp), which keeps a team of worker threads for every
thread that has run a parallel region. Once the teams together outnumber the cores, libgomp
stops spin-waiting between regions (its throttled spin count) and each op of a forward
waits on a futex wake-up. The services used to load their model on one thread (asyncio's
``to_thread``) and run it on another (the batcher's worker): two teams. Each layout runs in
a fresh process (the teams are per process), the embedded target in bfloat16, a B = 16
decode step (n = 1) and a 16-block γ = 4 verify (n = 5) over held-out HumanEval prefixes,
median of repeats:

- ``load and run on the main thread``: scripts/forward_cost.py's layout;
- ``load on one thread, run on another``: the services before asymspec.model_thread;
- ``load and run on one worker thread``: the services now (ModelThread).

Writes ``model_thread_cost.json`` and ``.txt`` with the machine's CPU model and flags.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from forward_cost import forward_s  # the engine benchmark's measurement (scripts/ is on the path)

from asymspec_engine.embedded import EMBEDDED_TARGET
from asymspec_engine.hardware import machine_facts
from asymspec_engine.llama import LlamaEngine
from asymspec_engine.loading import load_causal_lm
from asymspec.prompts import humaneval_prompts

LAYOUTS = {
    "main": "load and run on the main thread",
    "split": "load on one thread, run on another",
    "worker": "load and run on one worker thread",
}


def load(threads: int) -> tuple[LlamaEngine, list[list[int]]]:
    torch.set_num_threads(threads)
    model, tokenizer = load_causal_lm(EMBEDDED_TARGET, "cpu", torch.bfloat16)
    prompts = [tokenizer(p)["input_ids"] for p in humaneval_prompts("heldout")[:16]]
    return LlamaEngine(model), prompts


def forwards_ms(engine: LlamaEngine, prompts: list[list[int]], threads: int) -> dict[str, float]:
    torch.set_num_threads(threads)
    return {f"16x{n}": round(1000 * forward_s(engine, prompts, 16, n), 1) for n in (1, 5)}


def one_layout(layout: str, threads: int) -> dict[str, float]:
    if layout == "main":
        engine, prompts = load(threads)
        return forwards_ms(engine, prompts, threads)
    runner = ThreadPoolExecutor(1)
    loader = ThreadPoolExecutor(1) if layout == "split" else runner
    engine, prompts = loader.submit(load, threads).result()
    return runner.submit(forwards_ms, engine, prompts, threads).result()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("loadtest/results/model-thread"))
    parser.add_argument("--layout", choices=sorted(LAYOUTS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.layout:  # a child: one layout, one fresh process
        print(json.dumps(one_layout(args.layout, args.threads)))
        return
    rows = []
    for threads in sorted({1, args.threads}):
        for layout, label in LAYOUTS.items():
            child = [sys.executable, __file__, "--layout", layout, "--threads", str(threads)]
            out = subprocess.run(child, check=True, capture_output=True, text=True).stdout
            row = {"layout": label, "torch_threads": threads, **json.loads(out.splitlines()[-1])}
            print(row, flush=True)
            rows.append(row)
    args.out.mkdir(parents=True, exist_ok=True)
    facts = {**machine_facts(), "dtype": "bfloat16", "model": EMBEDDED_TARGET}
    (args.out / "model_thread_cost.json").write_text(
        json.dumps({"machine": facts, "rows": rows}, indent=2) + "\n"
    )
    lines = [f"machine: {json.dumps(facts)}", "", "| layout | torch threads | 16x1 ms | 16x5 ms |"]
    lines.append("|---|---|---|---|")
    lines += [f"| {r['layout']} | {r['torch_threads']} | {r['16x1']} | {r['16x5']} |" for r in rows]
    (args.out / "model_thread_cost.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
