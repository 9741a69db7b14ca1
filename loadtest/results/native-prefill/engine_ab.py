"""This change against the one before it, in one process, interleaved (the machine's speed
swings between runs by up to 2x, so separate runs cannot be compared):

- ``prefill``: one 1,984-token prompt (held-out HumanEval prompts) fed in 256-token chunks,
  prompt tokens/s, with prefill chunks' attention on the kernel's new prefill path against
  torch's flash attention (the path before);
- ``forward``: B sessions x n new tokens (a 16-session decode step, a 16-block γ = 4 verify)
  with the pointwise kernel of ``--before`` against this one (rows of norms and SiLU split
  over the two threads).

    .venv/bin/python loadtest/results/native-prefill/engine_ab.py --before bb324f7
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from asymspec.backends.embedded import EMBEDDED_TARGET
from asymspec.backends.hardware import machine_facts
from asymspec.backends.llama import LlamaEngine
from asymspec.backends.loading import load_causal_lm
from asymspec.backends.native_attention import NativeAttention
from asymspec.backends.native_build import NativeKernelSettings, build
from asymspec.prompts import humaneval_prompts


def old_pointwise(commit: str, cache: Path) -> object:
    """The pointwise kernel and its wrapper as they were at ``commit``."""
    for name in ("native_pointwise.c", "native_pointwise.py"):
        text = subprocess.run(
            ["git", "show", f"{commit}:shared/asymspec/backends/{name}"],
            check=True, capture_output=True, text=True,
        ).stdout  # fmt: skip
        (cache / name).write_text(text)
    spec = importlib.util.spec_from_file_location("pointwise_before", cache / "native_pointwise.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.NativePointwise(
        build(cache / "native_pointwise.c", NativeKernelSettings(kernel_cache=cache), module.LIBS)
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--before", default="bb324f7")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("engine_ab"))
    args = parser.parse_args()
    torch.set_num_threads(2)
    model, tokenizer = load_causal_lm(EMBEDDED_TARGET, dtype=torch.bfloat16)
    engine = LlamaEngine(model)
    assert engine.native_attention is not None and engine.pointwise is not None
    prompts = [tokenizer(p)["input_ids"] for p in humaneval_prompts()]
    results: dict[str, dict[str, list[float]]] = {}

    # prefill: the native path toggled through the predicate the engine asks
    prefill_on = [True]
    native_prefills = NativeAttention.prefills
    NativeAttention.prefills = (  # type: ignore[method-assign]
        lambda self, head_dim: prefill_on[0] and native_prefills(self, head_dim)
    )
    long_ids = [t for ids in prompts for t in ids][:1984]

    def prefill() -> float:
        start = time.perf_counter()
        engine.open("long", long_ids[:256])
        for at in range(256, len(long_ids), 256):
            engine.forward_new([("long", long_ids[at : at + 256])], keep_rows=[0])
        elapsed = time.perf_counter() - start
        engine.close("long")
        return len(long_ids) / elapsed

    variants = {"torch flash (before)": False, "native prefill (after)": True}
    prefill()  # warm-up
    for _ in range(args.repeats):
        for name, on in variants.items():
            prefill_on[0] = on
            results.setdefault("prefill tok/s", {}).setdefault(name, []).append(prefill())
    prefill_on[0] = True

    # forwards: the pointwise kernel swapped
    kernels = {"pointwise before": old_pointwise(args.before, Path(tempfile.mkdtemp())),
               "pointwise after": engine.pointwise}  # fmt: skip

    def forward_ms(sessions: int, n: int) -> Callable[[], float]:
        batch = []
        for i in range(sessions):
            ids = prompts[i % len(prompts)]
            engine.open(f"s{i}", ids[:-n])
            batch.append((f"s{i}", ids[-n:]))
        lengths = {sid: engine.length(sid) for sid, _ in batch}

        def run() -> float:
            start = time.perf_counter()
            engine.forward_new(batch, keep_rows=[n] * sessions)
            elapsed = time.perf_counter() - start
            for sid, length in lengths.items():
                engine.truncate(sid, length)
            return elapsed * 1e3

        return run

    for sessions, n in ((1, 1), (16, 1), (16, 5)):
        run = forward_ms(sessions, n)
        run()
        for _ in range(args.repeats):
            for name, kernel in kernels.items():
                engine.pointwise = kernel  # type: ignore[assignment]
                key = f"{sessions} x {n} forward ms"
                results.setdefault(key, {}).setdefault(name, []).append(run())
        for i in range(sessions):
            engine.close(f"s{i}")

    facts = machine_facts()
    summary = {
        key: {name: round(statistics.median(v), 2) for name, v in by.items()}
        for key, by in results.items()
    }
    print(json.dumps(summary, indent=1))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "engine_ab.json").write_text(
        json.dumps({"machine": facts, "medians": summary, "runs": results}, indent=1)
    )


if __name__ == "__main__":
    main()
