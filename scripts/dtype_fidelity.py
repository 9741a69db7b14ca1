"""What bf16 changes against float32, teacher-forced on held-out prompts (no sampling noise).

    .venv/bin/python scripts/dtype_fidelity.py [--prompts 12] [--threads 2]
        [--out loadtest/results/backends-engine/dtype_fidelity.json]

For the embedded target and draft in float32 and in bfloat16 (LlamaEngine, one full
forward per prompt): the acceptance probability sum_v min(p, q) at T = 0.7 per position,
averaged (what speculative decoding accepts in expectation), and the target's argmax
agreement between the dtypes. Sampled runs (bench_backends.py section e) follow different
trajectories per dtype; this isolates the numerics.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from asymspec_engine.embedded import EMBEDDED_DRAFT, EMBEDDED_TARGET
from asymspec_engine.hardware import machine_facts
from asymspec_engine.llama import LlamaEngine
from asymspec_engine.loading import load_causal_lm
from asymspec.prompts import humaneval_prompts
from asymspec.sampling import SamplingParams, transform

SAMPLED = SamplingParams(temperature=0.7)


def prompt_rows(name: str, dtype: torch.dtype, prompts: list[list[int]]) -> list[torch.Tensor]:
    model, _ = load_causal_lm(name, "cpu", dtype)
    lm = LlamaEngine(model)
    rows = []
    for i, ids in enumerate(prompts):
        lm.open(f"p{i}", [])
        rows.extend(lm.forward_new([(f"p{i}", ids)]))
    return rows  # per prompt [len, V]


def acceptance(p_rows: list[torch.Tensor], q_rows: list[torch.Tensor]) -> float:
    total = positions = 0.0
    for p, q in zip(p_rows, q_rows, strict=True):
        total += float(torch.minimum(transform(p, SAMPLED), transform(q, SAMPLED)).sum())
        positions += p.shape[0]
    return total / positions


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--out", type=Path, default=Path("loadtest/results/backends-engine/dtype_fidelity.json")
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    _, tokenizer = load_causal_lm(EMBEDDED_DRAFT, "cpu")
    prompts = [tokenizer(t).input_ids for t in humaneval_prompts("heldout")[: args.prompts]]
    rows = {
        dtype: (
            prompt_rows(EMBEDDED_TARGET, dtype, prompts),
            prompt_rows(EMBEDDED_DRAFT, dtype, prompts),
        )
        for dtype in (torch.float32, torch.bfloat16)
    }
    fp32, bf16 = rows[torch.float32], rows[torch.bfloat16]
    pairs = zip(bf16[0], fp32[0], strict=True)
    agree = sum(int((a.argmax(-1) == b.argmax(-1)).sum()) for a, b in pairs)
    result = {
        "machine": machine_facts(),
        "prompts": args.prompts,
        "positions": sum(r.shape[0] for r in fp32[0]),
        "acceptance_T0.7_float32": round(acceptance(*fp32), 4),
        "acceptance_T0.7_bfloat16": round(acceptance(*bf16), 4),
        "target_argmax_agreement_bf16_vs_fp32": round(agree / sum(r.shape[0] for r in fp32[0]), 4),
    }
    print(json.dumps(result, indent=1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
