"""Target forward time against the positions it scores, old engine against new.

    .venv/bin/python scripts/forward_cost.py [--target NAME_OR_PATH] [--threads 1]
        [--out loadtest/results/forward_cost]

One batched ``forward_new`` over B sessions (held-out HumanEval prompts as cached
prefixes, ~50-200 tokens) with n new tokens each: n = 1 is a decode step (logits for 1 row
per session), n = γ + 1 = 5 the verification of one γ = 4 block (logits for all 5 rows).
Median of repeats, the cache rolled back after each. Engines: ``CachedLM`` (transformers,
float32: what main ran before the new engine) and ``LlamaEngine`` in float32, bfloat16 (on
AMX CPUs also with oneDNN's products instead of the native kernel's: ``bfloat16-oneDNN``) and,
on x86 CPUs with AVX2, float32 with float16 weights (FBGEMM).
Also the roofline: the same layers' matrix products alone (``matmul_only``), so what an
engine adds beside them is visible. Writes ``forward_cost.json`` and ``forward_cost.txt``,
both with the machine's CPU model and flags, torch threads and dtype.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from asymspec_engine.embedded import EMBEDDED_TARGET
from asymspec_engine.engine import CachedLM, SessionLM
from asymspec_engine.hardware import cpu_has_amx, fp16_weights_supported, machine_facts
from asymspec_engine.llama import LlamaEngine
from asymspec_engine.loading import load_causal_lm
from asymspec.prompts import humaneval_prompts

SHAPES = ((1, 1), (1, 5), (16, 1), (16, 5), (32, 1), (32, 5))  # (sessions B, new tokens n)


def median_s(run: Callable[[], None], after: Callable[[], None], repeats: int = 7) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
        after()
    return statistics.median(times[1:])  # the first is a warm-up


def forward_s(lm: SessionLM, prompts: list[list[int]], sessions: int, n: int) -> float:
    batch = []
    for i in range(sessions):
        ids = prompts[i % len(prompts)]
        session_id = f"b{sessions}n{n}s{i}"
        lm.open(session_id, ids[:-n])
        batch.append((session_id, ids[-n:]))
    lengths = {session_id: lm.length(session_id) for session_id, _ in batch}
    keep = [n] * sessions  # a verify needs all γ+1 rows, a decode step its one row

    def rollback() -> None:
        for session_id, length in lengths.items():
            lm.truncate(session_id, length)

    seconds = median_s(lambda: lm.forward_new(batch, keep_rows=keep), rollback)
    for session_id, _ in batch:
        lm.close(session_id)
    return seconds


def matmul_only_s(engine: LlamaEngine, rows: int) -> float:
    """The engine's own (packed) projections and LM head on ``rows`` rows, nothing else."""
    hidden = engine.embed.shape[1]
    x = torch.randn(rows, hidden, dtype=engine.dtype)
    inner = torch.randn(rows, engine.num_heads * engine.head_dim, dtype=engine.dtype)
    mlp = torch.randn(rows, engine.layers[0].down_in, dtype=engine.dtype)

    def run() -> None:
        with torch.inference_mode():
            for layer in engine.layers:
                layer.qkv(x)
                layer.o(inner)
                layer.gate_up(x)
                layer.down(mlp)
            engine.head(x)

    return median_s(run, lambda: None)


def read_bandwidth_gb_s(megabytes: int = 256) -> float:
    """Sustained read bandwidth at this thread count: a sum over a touched buffer larger
    than the caches' useful share (the roofline's memory side)."""
    buffer = torch.randn(megabytes * 1024 * 1024 // 4)  # randn touches every page
    seconds = median_s(lambda: buffer.sum(), lambda: None)
    return megabytes / 1024 / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default=EMBEDDED_TARGET)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=Path("loadtest/results/forward_cost"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    facts = machine_facts()
    lines = [f"machine: {json.dumps(facts)}", ""]
    results: list[dict[str, object]] = []

    def report(line: str) -> None:
        print(line, flush=True)
        lines.append(line)

    # (engine, precision label, model dtype, build)
    engines: list[tuple[str, str, torch.dtype, Callable[[torch.nn.Module], SessionLM]]] = [
        ("CachedLM", "float32", torch.float32, CachedLM),
        ("LlamaEngine", "float32", torch.float32, LlamaEngine),
        ("LlamaEngine", "bfloat16", torch.bfloat16, LlamaEngine),
    ]
    if cpu_has_amx():  # the default bf16 engine runs the native AMX products; oneDNN's beside
        engines.append(
            (
                "LlamaEngine",
                "bfloat16-oneDNN",
                torch.bfloat16,
                lambda model: LlamaEngine(model, native_linear=False),
            )
        )
    if fp16_weights_supported():  # x86 with AVX2: FBGEMM's fp16 weights, fp32 activations
        engines.append(
            (
                "LlamaEngine",
                "float16-weights",
                torch.float32,
                lambda model: LlamaEngine(model, fp16_weights=True),
            )
        )
    for name, label, dtype, build in engines:
        model, tokenizer = load_causal_lm(args.target, "cpu", dtype)
        parameters = sum(p.numel() for p in model.parameters())  # tied weights once
        lm = build(model)
        prompts = [tokenizer(p).input_ids for p in humaneval_prompts("heldout")]
        for sessions, n in SHAPES:
            seconds = forward_s(lm, prompts, sessions, n)
            row: dict[str, object] = {
                "engine": name,
                "dtype": label,
                "sessions": sessions,
                "new_tokens": n,
                "forward_ms": round(1e3 * seconds, 2),
            }
            if isinstance(lm, LlamaEngine):
                row["matmul_only_ms"] = round(1e3 * matmul_only_s(lm, sessions * n), 2)
            results.append(row)
            report(
                f"{name:11s} {label:15s} B={sessions:2d} x n={n}: "
                f"{row['forward_ms']:7.1f} ms"
                + (
                    f"  (matmuls alone {row['matmul_only_ms']:6.1f} ms)"
                    if "matmul_only_ms" in row
                    else ""
                )
            )
        del lm, model

    def ms(engine: str, dtype: str, b: int, n: int) -> float:
        for r in results:
            if (r["engine"], r["dtype"], r["sessions"], r["new_tokens"]) == (engine, dtype, b, n):
                return float(r["forward_ms"])  # type: ignore[arg-type]
        raise KeyError((engine, dtype, b, n))

    bandwidth = read_bandwidth_gb_s()
    labels = [label for name, label, _, _ in engines if name == "LlamaEngine"]
    weight_bytes = {label: (4 if label == "float32" else 2) * parameters for label in labels}
    report("")
    report(f"read bandwidth at {args.threads} thread(s): {bandwidth:.1f} GB/s")
    for dtype, size in weight_bytes.items():
        floor_ms = 1e3 * size / 1e9 / bandwidth
        report(
            f"roofline {dtype}: {size / 1e6:.0f} MB of weights read once per forward -> "
            f">= {floor_ms:.1f} ms per forward while memory-bound (few rows)"
        )
    report("")
    for dtype in labels:
        verify_ratio = ms("LlamaEngine", dtype, 16, 5) / ms("LlamaEngine", dtype, 16, 1)
        decode_ratio = ms("LlamaEngine", dtype, 1, 1) / ms("CachedLM", "float32", 1, 1)
        report(
            f"LlamaEngine {dtype}: 16-block verify / 16-session decode = {verify_ratio:.2f} "
            f"(bar <= 1.5); one-session decode / CachedLM's = {decode_ratio:.2f} (bar <= 1/3)"
        )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "forward_cost.json").write_text(
        json.dumps(
            {
                "machine": facts,
                "threads": args.threads,
                "read_bandwidth_gb_s": round(bandwidth, 2),
                "weight_bytes": weight_bytes,
                "results": results,
            },
            indent=2,
        )
    )
    (args.out / "forward_cost.txt").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
