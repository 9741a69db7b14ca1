"""Loopback throughput: asymspec against target-only and draft-only at several concurrencies.

Real processes on 127.0.0.1 (no link shaping), the cloud pinned to core 1 and the edge to
core 0 with one torch thread each. For every (mode, concurrency) it sends the same
HumanEval held-out prompts as streaming completions and reports generated tokens per second
of wall time, the mean accepted draft tokens per block, and the edge busy fraction
(asymspec_edge_busy_seconds / (busy + idle) over the measured phase).

    .venv/bin/python scripts/bench_loopback.py --models embedded --out loadtest/results/loopback
    .venv/bin/python scripts/bench_loopback.py --models tiny --requests 8      # a smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx

from asymspec.prompts import humaneval_prompts

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the tests' helpers: real service processes, the tiny pair

from tests.services.processes import Service, free_port  # noqa: E402
from tests.services.tiny_models import save_tiny_pair  # noqa: E402

SECRET = "loopback-bench-secret"


def metric_sum(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))


@contextmanager
def pinned(module: str, cpu: int, port: int, env: dict[str, str], log: Path) -> Iterator[Service]:
    """A service process pinned to one core (taskset), like the testbed's benchmark."""
    env = {**env, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    service = Service(module, port, env, log)
    # Pin the already started process: taskset -p keeps the code path of Service intact.
    subprocess.run(["taskset", "-pc", str(cpu), str(service.proc.pid)], capture_output=True)
    try:
        service.wait_healthy(timeout_s=300)
        yield service
    finally:
        service.stop()


async def drive(url: str, prompts: list[str], concurrency: int, max_tokens: int) -> int:
    """Send every prompt (at most `concurrency` in flight); returns generated tokens."""
    limit = asyncio.Semaphore(concurrency)
    generated = 0
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:

        async def one(i: int, prompt: str) -> None:
            nonlocal generated
            body = {
                "model": "asymspec", "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0, "seed": i, "stream": True, "ignore_eos": True,
                "stream_options": {"include_usage": True},
            }  # fmt: skip
            async with limit, client.stream("POST", "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {") and '"usage"' in line:
                        usage = json.loads(line.removeprefix("data: ")).get("usage")
                        if usage:
                            generated += usage["completion_tokens"]

        await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    return generated


def measure(edge: Service, prompts: list[str], concurrency: int, max_tokens: int) -> dict:
    asyncio.run(drive(edge.url, prompts[:2], 2, 8))  # warm-up, not measured
    names = (
        "asymspec_spec_decode_num_accepted_tokens_total",
        "asymspec_spec_decode_num_drafts_total",
        "asymspec_edge_busy_seconds_total",
        "asymspec_edge_idle_seconds_total",
    )
    before = {n: metric_sum(edge.url, n) for n in names}
    started = time.perf_counter()
    tokens = asyncio.run(drive(edge.url, prompts, concurrency, max_tokens))
    wall_s = time.perf_counter() - started
    delta = {n: metric_sum(edge.url, n) - before[n] for n in names}
    drafts = delta["asymspec_spec_decode_num_drafts_total"]
    busy, idle = (
        delta["asymspec_edge_busy_seconds_total"],
        delta["asymspec_edge_idle_seconds_total"],
    )
    return {
        "concurrency": concurrency,
        "requests": len(prompts),
        "generated_tokens": tokens,
        "wall_s": round(wall_s, 2),
        "throughput_tok_s": round(tokens / wall_s, 2),
        "mean_accepted_per_block": round(
            delta["asymspec_spec_decode_num_accepted_tokens_total"] / drafts, 3
        ) if drafts else None,
        "edge_busy_fraction": round(busy / (busy + idle), 3) if busy + idle else None,
    }  # fmt: skip


def run(args: argparse.Namespace) -> list[dict]:
    prompts = humaneval_prompts("heldout")[: args.requests]
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        if args.models == "tiny":
            target, draft = (str(p) for p in save_tiny_pair(Path(tmp)))
        else:
            target, draft = "embedded:smollm2-135m-instruct", "embedded:smollm2-draft"
        cloud_port = free_port()
        cloud_env = {
            "ASYMSPEC_CLOUD_TARGET_MODEL": target, "ASYMSPEC_CLOUD_PORT": str(cloud_port),
            "ASYMSPEC_CLOUD_TORCH_THREADS": "1", "ASYMSPEC_CLOUD_SHARED_SECRET": SECRET,
        }  # fmt: skip
        stack.enter_context(pinned("cloud_verifier", 1, cloud_port, cloud_env, Path(tmp) / "c"))
        for mode in args.modes:
            edge_port = free_port()
            edge_env = {
                "ASYMSPEC_MODE": mode, "ASYMSPEC_EDGE_DRAFT_MODEL": draft,
                "ASYMSPEC_EDGE_PORT": str(edge_port), "ASYMSPEC_EDGE_TORCH_THREADS": "1",
                "ASYMSPEC_EDGE_SHARED_SECRET": SECRET,
                "ASYMSPEC_EDGE_CLOUD_URL": f"ws://127.0.0.1:{cloud_port}/v1/channel",
            }  # fmt: skip
            with pinned("edge_gateway", 0, edge_port, edge_env, Path(tmp) / mode) as edge:
                for concurrency in args.concurrency:
                    row = {"mode": mode, **measure(edge, prompts, concurrency, args.max_tokens)}
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    lines = [
        "| mode | concurrency | tokens/s | vs target-only | accepted/block | edge busy |",
        "|---|---|---|---|---|---|",
    ]
    target = {r["concurrency"]: r["throughput_tok_s"] for r in rows if r["mode"] == "target-only"}
    for r in rows:
        ratio = (
            r["throughput_tok_s"] / target[r["concurrency"]]
            if target.get(r["concurrency"])
            else None
        )
        lines.append(
            f"| {r['mode']} | {r['concurrency']} | {r['throughput_tok_s']:.2f} | "
            f"{'' if ratio is None else f'{ratio:.2f}x'} | {r['mean_accepted_per_block'] or ''} | "
            f"{r['edge_busy_fraction'] if r['edge_busy_fraction'] is not None else ''} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", choices=("embedded", "tiny"), default="embedded")
    parser.add_argument("--modes", nargs="+", default=["asymspec", "target-only", "draft-only"])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=REPO / "loadtest/results/loopback")
    args = parser.parse_args()
    rows = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    config = {k: v for k, v in vars(args).items() if k != "out"}
    (args.out / "results.json").write_text(json.dumps({"config": config, "rows": rows}, indent=1))
    (args.out / "results.md").write_text(table(rows) + "\n")
    print(table(rows))
    return 0


if __name__ == "__main__":
    os.chdir(REPO)
    sys.exit(main())
