"""One target forward's cost per engine: the shapes the cloud runs, side by side.

    .venv/bin/python -m loadtest.forward_cost [--threads 2] [--repeats 7]
        [--out loadtest/results/forward-cost]

Engines on the embedded target: llama.cpp on the prepared Q8_0 file (the engine's default), on
a Q4_0 file made from the same source, and on the shipped Q4_1 file, and the torch engine in
float32 (the exact reference); the Q8_0 file once more with rounds left unpadded (what
``asymspec_engine.llama_passes`` saves). Shapes (``SHAPES``): one session's decode step and
blocks, sixteen sessions' decode steps (16 x 1) and γ = 4 verify blocks (16 x 5), decode
steps on streams with gaps between and ragged blocks, over 300-token prefixes, and a
1,024-token prefill. Each figure is the median of
``--repeats`` forwards (rolled back between them); engines take turns per shape, because
machines here are noisy. Beside the cost, each engine's fidelity to the float32 reference:
over every position of the everyday chat prompts (chat template applied), the mean total
variation of its next-token distribution from the reference's and how often its most
likely next token is the reference's. Results: ``results.json`` and ``results.md``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer

from asymspec_engine.embedded import EMBEDDED_TARGET
from asymspec_engine.engine import SessionLM
from asymspec_engine.gguf_export import quantize
from asymspec_engine.hardware import machine_facts
from asymspec_engine.llama import LlamaEngine
from asymspec_engine.llamacpp import ENGINE_GGUF, LlamaCppEngine
from asymspec_engine.loading import load_causal_lm, resolve_model
from asymspec_engine.prepare import gguf_path
from loadtest.prompts import chat_prompts

REPO = Path(__file__).resolve().parents[1]
PREFIX_TOKENS = 300
# (session, new tokens) per forward: a decode step and verifies of γ = 1, 2 and 4 for one
# session, suffix blocks of 8, 16 and 32 tokens, then decode steps and γ = 4 verifies for
# sixteen, ten decode steps on streams with gaps between them (sessions that ended or wait),
# and sixteen verify blocks of 1 to 5 tokens (llama.cpp: a pass per run of consecutive
# streams with equal tokens, unless padded; ``asymspec_engine.llama_passes``)
SHAPES: dict[str, list[tuple[int, int]]] = {
    **{f"1 x {n}": [(0, n)] for n in (1, 2, 3, 5, 9, 17, 33)},
    "16 x 1": [(i, 1) for i in range(16)],
    "16 x 5": [(i, 5) for i in range(16)],
    "10 x 1, gaps between": [(i, 1) for i in (0, 2, 3, 5, 7, 8, 10, 11, 13, 15)],
    "16 x 1 to 5 (46 rows)": [(i, 1 + i * 7 % 5) for i in range(16)],
}
PREFILL_TOKENS = 1024
REFERENCE = "torch float32"


def engines(threads: int) -> dict[str, Callable[[], SessionLM]]:
    folder = Path(resolve_model(EMBEDDED_TARGET))

    def torch_engine() -> SessionLM:
        torch.set_num_threads(threads)
        model, _ = load_causal_lm(EMBEDDED_TARGET, "cpu", torch.float32)
        return LlamaEngine(model)

    def q4_0_engine() -> SessionLM:
        q4_0 = folder.parent / f".{folder.name}.q4_0.gguf"
        if not q4_0.is_file():
            quantize(gguf_path(), q4_0, "q4_0")
        return LlamaCppEngine(q4_0, threads, max_sessions=17)

    return {
        "llama.cpp Q8_0": lambda: LlamaCppEngine(folder / ENGINE_GGUF, threads, max_sessions=17),
        "llama.cpp Q8_0, unpadded": lambda: LlamaCppEngine(
            folder / ENGINE_GGUF, threads, max_sessions=17, pad_rounds=False
        ),
        "llama.cpp Q4_0": q4_0_engine,
        "llama.cpp Q4_1": lambda: LlamaCppEngine(gguf_path(), threads, max_sessions=17),
        REFERENCE: torch_engine,
    }


def timed(lm: SessionLM, shape: list[tuple[int, int]], repeats: int) -> float:
    """Median seconds of a forward of each (session, new tokens) of ``shape``."""
    batch = [(f"s{i}", [100 + (i + j) % 500 for j in range(new)]) for i, new in shape]
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        lm.forward_new(batch, keep_rows=[new for _, new in shape])
        seconds.append(time.perf_counter() - started)
        for i, _ in shape:
            lm.truncate(f"s{i}", PREFIX_TOKENS)
    return statistics.median(seconds)


def prefill_rate(lm: SessionLM, repeats: int) -> float:
    """Tokens per second of a ``PREFILL_TOKENS`` prompt in one forward."""
    prompt = [100 + j % 1000 for j in range(PREFILL_TOKENS)]
    seconds = []
    for _ in range(max(1, repeats // 2)):
        lm.open("prefill", [])
        started = time.perf_counter()
        lm.forward_new([("prefill", prompt)], keep_rows=[1])
        seconds.append(time.perf_counter() - started)
        lm.close("prefill")
    return PREFILL_TOKENS / statistics.median(seconds)


def fidelity(loaded: dict[str, SessionLM], reference: str) -> list[dict[str, Any]]:
    """Per engine: mean total variation from ``reference``'s next-token distributions and
    the share of positions where both rank the same token first (teacher-forced prompts)."""
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(EMBEDDED_TARGET))
    prompts = [
        tokenizer(tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False))
        for chat in chat_prompts()
    ]
    rows: dict[str, list[torch.Tensor]] = {name: [] for name in loaded}
    for encoded in prompts:
        ids = list(encoded["input_ids"])
        for name, lm in loaded.items():
            lm.open("fidelity", ids[:1])
            (logits,) = lm.forward_new([("fidelity", ids[1:])], keep_rows=[len(ids) - 1])
            lm.close("fidelity")
            rows[name].append(logits.float())
    expected = torch.cat(rows[reference])
    p_expected = torch.softmax(expected, -1)
    out = []
    for name in loaded:
        if name == reference:
            continue
        got = torch.cat(rows[name])
        tv = 0.5 * (torch.softmax(got, -1) - p_expected).abs().sum(-1)
        same_first = (got.argmax(-1) == expected.argmax(-1)).float().mean()
        out.append(
            {
                "engine": name,
                "shape": "fidelity",
                "mean_tv": round(float(tv.mean()), 4),
                "same_first_token": round(float(same_first), 4),
                "positions": len(tv),
            }
        )
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path, default=REPO / "loadtest/results/forward-cost")
    args = parser.parse_args()
    loaded = {name: start() for name, start in engines(args.threads).items()}
    prefix = [100 + j % 400 for j in range(PREFIX_TOKENS)]
    for lm in loaded.values():
        for i in range(16):
            lm.open(f"s{i}", prefix)
    rows: list[dict[str, Any]] = []
    for shape, items in SHAPES.items():
        for name, lm in loaded.items():
            ms = 1e3 * timed(lm, items, args.repeats)
            rows.append({"engine": name, "shape": shape, "ms": round(ms, 2)})
            print(json.dumps(rows[-1]), flush=True)
    for name, lm in loaded.items():
        rows.append({"engine": name, "shape": "prefill", "tok_s": round(prefill_rate(lm, 4))})
        print(json.dumps(rows[-1]), flush=True)
    rows += fidelity(loaded, REFERENCE)
    names = list(loaded)
    lines = ["| forward | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for shape in [*SHAPES, "prefill"]:
        cells = []
        for name in names:
            row = next(r for r in rows if r["engine"] == name and r["shape"] == shape)
            cells.append(f"{row['ms']} ms" if "ms" in row else f"{row['tok_s']} tok/s")
        label = (
            f"{shape} ({PREFIX_TOKENS}-token prefixes)"
            if shape != "prefill"
            else (f"prefill of {PREFILL_TOKENS} tokens")
        )
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    fidelities = {r["engine"]: r for r in rows if r["shape"] == "fidelity"}
    for label, key in (
        ("mean TV from float32", "mean_tv"),
        ("same next token", "same_first_token"),
    ):
        cells = [str(fidelities[n][key]) if n in fidelities else "reference" for n in names]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    facts = {**machine_facts(), "threads": args.threads}
    command = f".venv/bin/python -m loadtest.forward_cost --threads {args.threads}"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(
        json.dumps({"command": command, "machine": facts, "rows": rows}, indent=1)
    )
    table = "\n".join(lines)
    (args.out / "results.md").write_text(
        f"`{command}`\n\nmachine: {json.dumps(facts)}\n\n{table}\n"
    )
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
