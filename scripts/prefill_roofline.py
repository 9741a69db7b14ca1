"""How fast the target can prefill here: the engine against its matrix products and the
CPU's bf16 peak.

    .venv/bin/python scripts/prefill_roofline.py [--threads 2] [--tokens 1984]
        [--chunk 256] [--out loadtest/results/prefill_roofline]

Three figures in prompt tokens per second, for one prompt of ``--tokens`` tokens fed in
``--chunk``-token chunks (what the cloud does with a long prompt when nothing else runs):

- ``engine``: ``LlamaEngine.forward_new`` chunk after chunk, no logits (keep_rows 0);
- ``products``: the same chunks through the model's matrix products alone (the layers'
  packed bf16 weights, ``_Linear``), i.e. the engine without attention, norms and glue;
- ``peak``: the model's FLOPs per token (2 x parameters in the layers, plus causal
  attention's 2 x 2 x L/2 x heads x head_dim per layer at the prompt's mean position)
  at the bf16 matmul peak measured on 2048 x 2048 x 2048 products.

A prefill bar above ``peak`` cannot be met on this CPU by any engine; one above
``products`` not by an engine using these kernels. ``--profile`` adds where the engine's
prefill time goes (torch.profiler, self CPU time by op). Writes prefill_roofline.json and
.txt with the CPU model and flags, torch threads and dtype.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch

from asymspec_engine.embedded import EMBEDDED_TARGET
from asymspec_engine.hardware import machine_facts
from asymspec_engine.llama import LlamaEngine
from asymspec_engine.loading import load_causal_lm
from asymspec.prompts import humaneval_prompts


def best_s(run: Callable[[], object], repeats: int = 3) -> float:
    run()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=1984)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--out", type=Path, default=Path("loadtest/results/prefill_roofline"))
    parser.add_argument("--profile", action="store_true", help="also the engine's op profile")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_causal_lm(EMBEDDED_TARGET, dtype=torch.bfloat16)
    engine = LlamaEngine(model)
    text = "\n".join(humaneval_prompts())
    prompt = tokenizer(text)["input_ids"][: args.tokens]
    chunks = [prompt[i : i + args.chunk] for i in range(0, len(prompt), args.chunk)]

    def prefill() -> None:
        engine.open("p", [])
        for chunk in chunks:
            engine.forward_new([("p", chunk)], keep_rows=[0])
        engine.close("p")

    hidden = int(model.config.hidden_size)
    inputs = [torch.randn(len(c), hidden, dtype=torch.bfloat16) for c in chunks]

    def products() -> None:
        for x in inputs:
            for layer in engine.layers:
                layer.qkv(x)
                layer.o(x)
                up = layer.gate_up(x)
                layer.down(up[:, : layer.down_in])

    size = 2048
    a = torch.randn(size, size, dtype=torch.bfloat16)
    b = torch.randn(size, size, dtype=torch.bfloat16)
    peak_flops = 2 * size**3 / best_s(lambda: a @ b)
    config = model.config
    layer_params = sum(p.numel() for p in model.model.layers.parameters())
    heads, head_dim = int(config.num_attention_heads), hidden // int(config.num_attention_heads)
    mean_position = len(prompt) / 2
    attention_flops = 2 * 2 * (mean_position / 2) * heads * head_dim * len(model.model.layers)
    flops_per_token = 2 * layer_params + attention_flops
    figures = {
        "engine_tok_s": len(prompt) / best_s(prefill),
        "products_tok_s": len(prompt) / best_s(products),
        "peak_tok_s": peak_flops / flops_per_token,
        "peak_bf16_gflop_s": peak_flops / 1e9,
        "gflop_per_token": flops_per_token / 1e9,
        "prompt_tokens": len(prompt),
        "chunk_tokens": args.chunk,
    }
    facts = {**machine_facts(), "dtype": "bfloat16", "layout": engine.layout.value}
    lines = [f"machine: {json.dumps(facts)}", ""]
    lines += [f"{key}: {value:.1f}" for key, value in figures.items()]
    if args.profile:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            prefill()
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)
        lines += ["", "engine prefill, self CPU time by op:", table]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "prefill_roofline.json").write_text(
        json.dumps({"machine": facts, **figures}, indent=1) + "\n"
    )
    (args.out / "prefill_roofline.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
