"""What the native decode/verify attention kernel saves a forward: the same engine with it
and without it (torch's flash attention, one call per session and layer), interleaved.

    .venv/bin/python scripts/attention_cost.py [--model NAME_OR_PATH] [--threads 1 2]
        [--out loadtest/results/native-attention/attention_cost]

B sessions, each with a cached prefix of held-out HumanEval prompts back to back
(``--positions``, ~500 tokens, the length of a chat turn or two), forward n new tokens:
n = 1 is a decode step, n = 5 the verification of a γ = 4 block. Two ``LlamaEngine``s on
the same bf16 weights take turns call by call (``bench_backends.interleaved_medians``),
each rolled back after every call. Also the attention's memory floor: the bytes of keys and
values a forward reads, at the measured read bandwidth. Writes ``attention_cost.json`` and
``attention_cost.txt`` with the CPU model and flags, torch threads and dtype.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import torch

from asymspec_engine.embedded import EMBEDDED_TARGET
from asymspec_engine.hardware import machine_facts
from asymspec_engine.llama import LlamaEngine
from asymspec_engine.loading import load_causal_lm
from asymspec.prompts import humaneval_prompts

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_backends import interleaved_medians, long_context
from forward_cost import read_bandwidth_gb_s

SHAPES = ((1, 1), (1, 5), (16, 1), (16, 5), (32, 1), (32, 5))  # (sessions B, new tokens n)


def forward_and_roll_back(
    engine: LlamaEngine, batch: list[tuple[str, list[int]]], lengths: list[int]
) -> None:
    engine.forward_new(batch)  # every new row's logits: a verify's γ + 1, a decode step's 1
    for (session_id, _), length in zip(batch, lengths, strict=True):
        engine.truncate(session_id, length)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=EMBEDDED_TARGET)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--positions", type=int, default=500)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--out", type=Path, default=Path("loadtest/results/attention_cost"))
    args = parser.parse_args()
    model, tokenizer = load_causal_lm(args.model, "cpu", torch.bfloat16)
    engines = {
        "native": LlamaEngine(model, native_attention=True),
        "torch": LlamaEngine(model, native_attention=False),
    }
    prompts = [tokenizer(p).input_ids for p in humaneval_prompts("heldout")]
    prefix = long_context(prompts, args.positions + 64)
    first = engines["native"]
    kv_bytes_per_position = 2 * len(first.layers) * first.num_kv_heads * first.head_dim * 2
    facts = machine_facts()
    lines = [f"machine: {json.dumps(facts)}", f"model: {args.model} (bfloat16)", ""]
    results: list[dict[str, object]] = []

    def report(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    for threads in args.threads:
        torch.set_num_threads(threads)
        bandwidth = read_bandwidth_gb_s()
        report(f"threads {threads}: read bandwidth {bandwidth:.1f} GB/s")
        for sessions, n in SHAPES:
            # Ragged: session i caches positions + 2 i tokens.
            lengths = [args.positions + 2 * i for i in range(sessions)]
            batch = [
                (f"t{threads}b{sessions}n{n}s{i}", [int(t) for t in prefix[:n]])
                for i in range(sessions)
            ]
            for engine in engines.values():
                for (session_id, _), length in zip(batch, lengths, strict=True):
                    engine.open(session_id, prefix[:length])

            medians = interleaved_medians(
                {
                    name: functools.partial(forward_and_roll_back, engine, batch, lengths)
                    for name, engine in engines.items()
                },
                args.repeats,
            )
            kv_bytes = kv_bytes_per_position * sum(length + n for length in lengths)
            floor_ms = 1e3 * kv_bytes / 1e9 / bandwidth
            row = {
                "threads": threads,
                "sessions": sessions,
                "new_tokens": n,
                "cached_positions": lengths[0],
                "native_ms": round(1e3 * medians["native"], 2),
                "torch_ms": round(1e3 * medians["torch"], 2),
                "ratio": round(medians["native"] / medians["torch"], 3),
                "kv_read_floor_ms": round(floor_ms, 2),
            }
            results.append(row)
            report(
                f"  B={sessions:2d} x n={n}: native {row['native_ms']:7.1f} ms, torch "
                f"{row['torch_ms']:7.1f} ms, ratio {row['ratio']:.2f} (KV read floor "
                f"{floor_ms:.1f} ms)"
            )
            for engine in engines.values():
                for session_id, _ in batch:
                    engine.close(session_id)
        results.append({"threads": threads, "read_bandwidth_gb_s": round(bandwidth, 2)})
    args.out.mkdir(parents=True, exist_ok=True)
    payload = {"machine": facts, "model": args.model, "dtype": "bfloat16", "results": results}
    (args.out / "attention_cost.json").write_text(json.dumps(payload, indent=2))
    (args.out / "attention_cost.txt").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
