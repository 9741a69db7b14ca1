"""The pointwise kernel's calls at SmolLM2-135M's shapes, before and after this change
(the norms' and SiLU's rows split over torch's threads; the rotary for comparison),
interleaved in one process, best of ``--repeats`` runs of 200 calls each. The rotary works
in place: its input is restored before each run, outside the timing.

    .venv/bin/python loadtest/results/native-prefill/pointwise_cost.py --before bb324f7
"""

from __future__ import annotations

import argparse
import ctypes
import json
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from asymspec.backends.hardware import machine_facts
from asymspec.backends.native_build import NativeKernelSettings, build
from asymspec.backends.native_pointwise import LIBS, SOURCE

HIDDEN, INTER, HEADS, HEAD_DIM = 576, 1536, 12, 64


def load(source: Path, cache: Path) -> ctypes.CDLL:
    return ctypes.CDLL(str(build(source, NativeKernelSettings(kernel_cache=cache), LIBS)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--before", default="bb324f7")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("pointwise_cost"))
    args = parser.parse_args()
    torch.set_num_threads(2)
    cache = Path(tempfile.mkdtemp())
    old_source = cache / "native_pointwise_before.c"
    old_source.write_text(
        subprocess.run(
            ["git", "show", f"{args.before}:shared/asymspec/backends/native_pointwise.c"],
            check=True, capture_output=True, text=True,
        ).stdout
    )  # fmt: skip
    libs = {"before": (load(old_source, cache), ()), "after, 1 thread": (load(SOURCE, cache), (1,))}
    libs["after, 2 threads"] = (libs["after, 1 thread"][0], (2,))
    p = ctypes.c_void_p
    results = []
    for rows in (1, 16, 80):
        x = torch.randn(rows, HIDDEN).to(torch.bfloat16)
        delta = torch.randn(rows, HIDDEN).to(torch.bfloat16)
        w = torch.randn(HIDDEN).to(torch.bfloat16)
        out = torch.empty_like(x)
        qk0 = torch.randn(rows, HEADS, HEAD_DIM).to(torch.bfloat16)
        qk = qk0.clone()
        angle = torch.rand(rows, HEAD_DIM) * 6.28  # a rotation: qk keeps its scale call after call
        cos, sin = angle.cos().to(torch.bfloat16), angle.sin().to(torch.bfloat16)
        gate_up = (torch.randn(rows, 2 * INTER) * 3).to(torch.bfloat16)
        act = torch.empty(rows, INTER, dtype=torch.bfloat16)
        calls = {
            "add_rms_norm": lambda lib, extra: lib.asymspec_add_rms_norm(
                p(x.data_ptr()), p(delta.data_ptr()), ctypes.c_int64(rows),
                ctypes.c_int64(HIDDEN), p(w.data_ptr()), ctypes.c_float(1e-5),
                p(out.data_ptr()), *extra,
            ),
            "rotary": lambda lib, extra: lib.asymspec_rotary(
                p(qk.data_ptr()), ctypes.c_int64(rows), ctypes.c_int64(HEADS * HEAD_DIM),
                ctypes.c_int64(HEADS), ctypes.c_int64(HEAD_DIM), p(cos.data_ptr()),
                p(sin.data_ptr()),  # no thread count: it runs on the calling thread
            ),
            "silu_mul": lambda lib, extra: lib.asymspec_silu_mul(
                p(gate_up.data_ptr()), ctypes.c_int64(rows), ctypes.c_int64(INTER),
                p(act.data_ptr()), *extra,
            ),
        }  # fmt: skip
        for op, call in calls.items():
            best = {name: float("inf") for name in libs}
            for _ in range(args.repeats):
                for name, (lib, extra) in libs.items():
                    qk.copy_(qk0)
                    start = time.perf_counter()
                    for _ in range(200):
                        call(lib, extra)
                    best[name] = min(best[name], (time.perf_counter() - start) / 200 * 1e6)
            row = {"rows": rows, "op": op, **{k: round(v, 1) for k, v in best.items()}}
            print(json.dumps(row), flush=True)
            results.append(row)
    args.out.mkdir(parents=True, exist_ok=True)
    facts = machine_facts()
    (args.out / "pointwise_cost.json").write_text(
        json.dumps({"machine": facts, "unit": "us per call", "rows": results}, indent=1)
    )
    lines = [f"machine: {json.dumps(facts)}", "", "| rows | op | " + " | ".join(libs) + " |"]
    lines.append("|---" * (2 + len(libs)) + "|")
    for r in results:
        lines.append(f"| {r['rows']} | {r['op']} | " + " | ".join(str(r[k]) for k in libs) + " |")
    (args.out / "pointwise_cost.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
