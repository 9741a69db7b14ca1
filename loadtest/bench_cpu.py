"""CPU serving beside llama.cpp's own server: ``make run`` against ``llama-server`` on the
same GGUF file, with one streaming chat client, in one run.

    .venv/bin/python -m loadtest.bench_cpu [--concurrency 1 16] [--rounds 2]
        [--out loadtest/results/bench-cpu]

``make bench-cpu`` builds ``llama-server`` from the llama.cpp source the engine is built
from (``scripts/build_llama_server.sh``) and runs this. Servers, in turn, ``--rounds`` times
(interleaved, because machines here are noisy): ``llama-server -np 16`` on the embedded
target's prepared GGUF with its default threads; ``make run`` (``scripts/run_local.sh``,
its defaults) in ``target-only`` mode and in ``asymspec`` mode. Each streams chat
completions (everyday chat and held-out code prompts, 64 tokens, T = 0.7, seeded) at each
concurrency; the figure is completion tokens per second of wall time, and the ratios are
to llama-server's median at the same concurrency. Results: ``results.json`` (every run,
the machine's CPU model, flags and threads, the engine and its file) and ``results.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from asymspec_engine.embedded import EMBEDDED_TARGET
from asymspec_engine.hardware import machine_facts
from asymspec_engine.llamacpp import ENGINE_GGUF, ENGINE_QUANT
from asymspec_engine.loading import resolve_model
from loadtest.prompts import chat_prompts, code_as_chat, humaneval_prompts
from loadtest.server_process import ServerProcess, stream_chat

REPO = Path(__file__).resolve().parents[1]
LLAMA_SERVER = REPO / ".cache/llama-cpp-python/build/bin/llama-server"
EDGE_PORT, CLOUD_PORT, LLAMA_PORT = 18000, 18001, 18080
SECRET = "bench-cpu-secret"
SLOTS = 16  # llama-server's parallel slots, as make run's engine holds 16 sessions


def workload(requests: int) -> list[list[dict[str, str]]]:
    """Chat prompts and held-out code-as-chat prompts, interleaved, cycled to ``requests``."""
    chats = chat_prompts()
    codes = [code_as_chat(p) for p in humaneval_prompts("heldout")[: len(chats)]]
    mixed = [m for pair in zip(chats, codes, strict=True) for m in pair]
    return [mixed[i % len(mixed)] for i in range(requests)]


def target_gguf() -> Path:
    return Path(resolve_model(EMBEDDED_TARGET)) / ENGINE_GGUF


def llama_server(
    log: Path, port: int = LLAMA_PORT, name: str = "llama-server", extra: Sequence[str] = ()
) -> ServerProcess:
    """``llama-server -np 16`` on the embedded target's GGUF, with ``extra`` arguments."""
    argv = [
        str(LLAMA_SERVER), "-m", str(target_gguf()), "-np", str(SLOTS),
        "-c", str(SLOTS * 4096), "--host", "127.0.0.1", "--port", str(port), *extra,
    ]  # fmt: skip
    return ServerProcess(name, argv, {}, port, log)


def make_run(mode: str, log_dir: Path) -> ServerProcess:
    env = {
        "ASYMSPEC_MODE": mode,
        "ASYMSPEC_EDGE_PORT": str(EDGE_PORT),
        "ASYMSPEC_CLOUD_PORT": str(CLOUD_PORT),
        "ASYMSPEC_SHARED_SECRET": SECRET,
    }
    return ServerProcess(
        mode, ["bash", "scripts/run_local.sh"], env, EDGE_PORT, log_dir / f"{mode}.log"
    )


async def one_chat(
    client: httpx.AsyncClient, messages: list[dict[str, str]], seed: int, max_tokens: int
) -> dict[str, float]:
    body = {"model": "asymspec", "messages": messages, "max_tokens": max_tokens}
    chat = await stream_chat(client, {**body, "temperature": 0.7, "seed": seed})
    return {"ttft_s": chat.ttft_s, "e2e_s": chat.e2e_s, "tokens": chat.tokens}


async def drive(
    port: int, requests: list[list[dict[str, str]]], concurrency: int, max_tokens: int
) -> dict[str, Any]:
    limit = asyncio.Semaphore(concurrency)
    # A connection per request: llama-server closes idle keep-alive connections, and a
    # request sent on one as it closes fails; the same for every server, on loopback.
    fresh = httpx.Limits(max_keepalive_connections=0)
    url = f"http://127.0.0.1:{port}"
    async with httpx.AsyncClient(base_url=url, timeout=900, limits=fresh) as client:

        async def limited(i: int, messages: list[dict[str, str]]) -> dict[str, float]:
            async with limit:
                return await one_chat(client, messages, i, max_tokens)

        started = time.perf_counter()
        results = await asyncio.gather(*(limited(i, m) for i, m in enumerate(requests)))
        wall_s = time.perf_counter() - started
    tokens = sum(r["tokens"] for r in results)
    return {
        "concurrency": concurrency,
        "requests": len(requests),
        "completion_tokens": tokens,
        "wall_s": round(wall_s, 2),
        "throughput_tok_s": round(tokens / wall_s, 2),
        "ttft_p50_s": round(statistics.median(r["ttft_s"] for r in results), 3),
    }


def summary(rows: list[dict[str, Any]], servers: list[str], levels: list[int]) -> str:
    def median(server: str, c: int) -> float | None:
        got = [
            r["throughput_tok_s"] for r in rows if r["server"] == server and r["concurrency"] == c
        ]
        return statistics.median(got) if got else None

    lines = ["| server | C | tok/s (median) | runs | vs llama-server |", "|---|---|---|---|---|"]
    for server in servers:
        for c in levels:
            value, base = median(server, c), median("llama-server", c)
            if value is None:
                continue
            runs = sum(r["server"] == server and r["concurrency"] == c for r in rows)
            ratio = f"{value / base:.2f}x" if base else ""
            lines.append(f"| {server} | {c} | {value:.1f} | {runs} | {ratio} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--rounds", type=int, default=3, help="each server this many times")
    parser.add_argument("--requests-per-slot", type=int, default=2)
    parser.add_argument("--min-requests", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=REPO / "loadtest/results/bench-cpu")
    args = parser.parse_args()
    if not LLAMA_SERVER.is_file():
        parser.error(f"{LLAMA_SERVER} is missing: run `make llama-server` first")
    args.out.mkdir(parents=True, exist_ok=True)
    starts = {
        "llama-server": lambda: llama_server(args.out / "llama-server.log"),
        "make run target-only": lambda: make_run("target-only", args.out),
        "make run asymspec": lambda: make_run("asymspec", args.out),
    }
    facts = {
        **machine_facts(),
        "engine": "llama.cpp",
        "gguf": f"{target_gguf().name} ({ENGINE_QUANT.upper()}, the embedded target)",
        "llama_server": f"-np {SLOTS}, default threads ({os.cpu_count()})",
        "make_run_threads": "colocated: cloud 1 (every core while it decodes alone), edge 1",
    }
    config = {k: str(v) for k, v in vars(args).items() if k != "out"}
    command = "make bench-cpu  # .venv/bin/python -m loadtest.bench_cpu"
    rows: list[dict[str, Any]] = []

    def save() -> str:  # after every row: a run cut short keeps what it measured
        table = summary(rows, list(starts), args.concurrency)
        document = {"command": command, "machine": facts, "config": config, "rows": rows}
        (args.out / "results.json").write_text(json.dumps(document, indent=1))
        (args.out / "results.md").write_text(
            f"`{command}`\n\nmachine: {json.dumps(facts)}\n\n{table}\n"
        )
        return table

    for round_index in range(args.rounds):
        for name, start in starts.items():
            server = start()
            try:
                server.wait_ready()
                asyncio.run(drive(server.port, workload(2), 2, 8))  # warm-up, not measured
                for c in args.concurrency:
                    requests = max(args.min_requests, args.requests_per_slot * c)
                    row = {"server": name, "round": round_index}
                    row |= asyncio.run(drive(server.port, workload(requests), c, args.max_tokens))
                    print(json.dumps(row), flush=True)
                    rows.append(row)
                    save()
            finally:
                server.stop()
    table = save()
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
