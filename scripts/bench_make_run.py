"""What a new user sees: `make run`'s services, a streaming chat client, throughput.

    .venv/bin/python scripts/bench_make_run.py [--repo PATH] [--modes target-only asymspec]
        [--concurrency 1 16] [--out loadtest/results/make-run]

For each mode it starts ``scripts/run_local.sh`` of ``--repo`` (default: this checkout)
exactly as ``make run`` does, with its defaults (threads, dtype, engine), and only
``ASYMSPEC_MODE`` and the ports set; then streams chat completions (everyday chat prompts
and held-out HumanEval prompts asked as chat, mixed; 64 tokens, T = 0.7, seeded) at each
concurrency and reports completion tokens per second of wall time, TTFT and end-to-end
percentiles, and the edge's accepted tokens per block. ``--prefill`` adds the long-prompt
checks: prefill tokens/s of a ~2,000-token prompt (TTFT of a 1-token completion), and a
short request's latency alone and when sent 0.5 s after that long prompt
(``--prefill-repeats N``: N times, reporting medians).

``--repo`` may point at an older checkout (``git worktree add``) to measure it the same
way; its services then run from its own sources (PYTHONPATH) with this checkout's venv.
Results: ``results.json`` and ``results.md`` with the machine's CPU model, flags and threads.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "shared"))

from bench_loopback import metric_sum  # noqa: E402  # this folder: scripts run as files

from asymspec_engine.hardware import (  # noqa: E402
    colocated_threads,
    machine_facts,
    resolve_precision,
)
from asymspec.modes import get_mode  # noqa: E402
from asymspec.prompts import chat_prompts, code_as_chat, humaneval_prompts  # noqa: E402

EDGE_PORT, CLOUD_PORT = 18000, 18001


def service_precision(role: str) -> str:
    """The precision a service runs in here: its ASYMSPEC_*_DTYPE (auto unless set), resolved."""
    name = os.environ.get(f"ASYMSPEC_{role.upper()}_DTYPE", "auto")
    return f"{name} = {resolve_precision(name, 'cpu')}"


SECRET = "make-run-bench-secret"


def workload(requests: int) -> list[list[dict[str, str]]]:
    """Chat prompts and held-out code-as-chat prompts, interleaved, cycled to ``requests``."""
    chats = chat_prompts()
    codes = [code_as_chat(p) for p in humaneval_prompts("heldout")[: len(chats)]]
    mixed = [m for pair in zip(chats, codes, strict=True) for m in pair]
    return [mixed[i % len(mixed)] for i in range(requests)]


class Stack:
    """``scripts/run_local.sh`` of a checkout, in its own process group."""

    def __init__(self, repo: Path, mode: str, log: Path) -> None:
        env = {
            **os.environ,
            "ASYMSPEC_MODE": mode,
            "ASYMSPEC_EDGE_PORT": str(EDGE_PORT),
            "ASYMSPEC_CLOUD_PORT": str(CLOUD_PORT),
            "ASYMSPEC_SHARED_SECRET": SECRET,
        }
        if repo.resolve() != REPO:  # another checkout's sources, this venv
            env["PYTHONPATH"] = f"{repo / 'shared'}:{repo / 'services'}:{repo}"
            venv = repo / ".venv"
            if not venv.exists():
                venv.symlink_to(REPO / ".venv")
        self.log = log.open("w")
        self.proc = subprocess.Popen(
            ["bash", "scripts/run_local.sh"],
            cwd=repo,
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait_ready(self, timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"run_local.sh exited with {self.proc.returncode}")
            try:
                if httpx.get(f"http://127.0.0.1:{EDGE_PORT}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError("the edge did not become healthy")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


async def one_chat(
    client: httpx.AsyncClient, messages: list[dict[str, str]], seed: int, max_tokens: int
) -> dict[str, float]:
    body = {
        "model": "asymspec", "messages": messages, "max_tokens": max_tokens,
        "temperature": 0.7, "seed": seed, "stream": True,
        "stream_options": {"include_usage": True},
    }  # fmt: skip
    started = time.perf_counter()
    first: float | None = None
    tokens = 0
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if "error" in chunk:
                raise RuntimeError(chunk["error"])
            if first is None and any(c["delta"].get("content") for c in chunk["choices"]):
                first = time.perf_counter()
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    done = time.perf_counter()
    return {"ttft_s": (first or done) - started, "e2e_s": done - started, "tokens": tokens}


async def drive(requests: list[list[dict[str, str]]], concurrency: int, max_tokens: int) -> dict:
    limit = asyncio.Semaphore(concurrency)
    url = f"http://127.0.0.1:{EDGE_PORT}"
    async with httpx.AsyncClient(base_url=url, timeout=900) as client:

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
        "e2e_p50_s": round(statistics.median(r["e2e_s"] for r in results), 3),
        "e2e_max_s": round(max(r["e2e_s"] for r in results), 3),
    }


def edge_counter(name: str) -> float:
    return metric_sum(f"http://127.0.0.1:{EDGE_PORT}", name)


def measure(concurrency: int, requests: int, max_tokens: int) -> dict[str, Any]:
    names = (
        "asymspec_spec_decode_num_accepted_tokens_total",
        "asymspec_spec_decode_num_drafts_total",
    )
    before = {n: edge_counter(n) for n in names}
    row = asyncio.run(drive(workload(requests), concurrency, max_tokens))
    delta = {n: edge_counter(n) - before[n] for n in names}
    blocks = delta["asymspec_spec_decode_num_drafts_total"]
    row["accepted_per_block"] = (
        round(delta["asymspec_spec_decode_num_accepted_tokens_total"] / blocks, 3)
        if blocks
        else None
    )
    return row


def long_prompt(words: int) -> list[dict[str, str]]:
    text = " ".join(f"item{i % 97} costs {i % 13} coins;" for i in range(words))
    return [{"role": "user", "content": f"Here is a ledger: {text} What is the total?"}]


def measure_prefill(repeats: int = 1) -> dict[str, Any]:
    """Prefill rate of a ~2,000-token prompt, and a short request beside it; ``repeats``
    times (each a short request alone, the long prompt alone, then both), with the medians.
    The short request's slowdown depends on where in the long prompt's rounds it lands, so
    one sample of it varies by 1.5x between runs here."""
    long_messages = long_prompt(240)  # ~1,980 tokens with SmolLM2's tokenizer (limit 2,048)
    short = workload(1)[0]

    async def once(client: httpx.AsyncClient) -> dict[str, Any]:
        alone = await one_chat(client, short, 1, 32)
        body = {"model": "asymspec", "messages": long_messages, "max_tokens": 1}
        started = time.perf_counter()
        reply = await client.post("/v1/chat/completions", json=body)
        if reply.status_code != 200:
            raise RuntimeError(f"long prompt: {reply.status_code} {reply.text}")
        prefill_s = time.perf_counter() - started
        prompt_tokens = reply.json()["usage"]["prompt_tokens"]

        async def delayed_short() -> dict[str, float]:
            await asyncio.sleep(0.5)
            return await one_chat(client, short, 1, 32)

        body = {**body, "max_tokens": 8}
        started = time.perf_counter()
        _, beside = await asyncio.gather(
            client.post("/v1/chat/completions", json=body), delayed_short()
        )
        long_beside_s = time.perf_counter() - started
        return {
            "long_prompt_tokens": prompt_tokens,
            "long_prompt_ttft_s": round(prefill_s, 3),
            "prefill_tok_s": round(prompt_tokens / prefill_s, 1),
            "short_alone_e2e_s": round(alone["e2e_s"], 3),
            "short_beside_long_e2e_s": round(beside["e2e_s"], 3),
            "short_slowdown": round(beside["e2e_s"] / alone["e2e_s"], 3),
            "long_beside_short_e2e_s": round(long_beside_s, 3),  # the long one, 8 tokens
        }

    async def run() -> dict[str, Any]:
        url = f"http://127.0.0.1:{EDGE_PORT}"
        async with httpx.AsyncClient(base_url=url, timeout=900) as client:
            warm = await one_chat(client, short, 0, 32)
            runs = [await once(client) for _ in range(repeats)]
        medians = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
        out: dict[str, Any] = {"warm_up_e2e_s": round(warm["e2e_s"], 3), **medians}
        if repeats > 1:
            out["repeats"] = runs
        return out

    return asyncio.run(run())


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| checkout | mode | C | tok/s | vs target-only | TTFT p50 s | e2e p50 s | accepted/block |"
    )
    lines = [head, "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "throughput_tok_s" not in r:
            continue
        base = next(
            (
                b["throughput_tok_s"]
                for b in rows
                if b.get("mode") == "target-only"
                and b.get("concurrency") == r["concurrency"]
                and b["checkout"] == r["checkout"]
                and "throughput_tok_s" in b
            ),
            None,
        )
        ratio = f"{r['throughput_tok_s'] / base:.2f}x" if base else ""
        lines.append(
            f"| {r['checkout']} | {r['mode']} | {r['concurrency']} | {r['throughput_tok_s']} | "
            f"{ratio} | {r['ttft_p50_s']} | {r['e2e_p50_s']} | {r['accepted_per_block'] or ''} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo", type=Path, default=REPO)
    parser.add_argument("--label", default="this checkout")
    parser.add_argument("--modes", nargs="+", default=["target-only", "asymspec"])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--requests-per-slot", type=int, default=2)
    parser.add_argument("--min-requests", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prefill", action="store_true", help="also the long-prompt checks")
    parser.add_argument(
        "--prefill-repeats", type=int, default=1, help="long-prompt checks per mode (medians)"
    )
    parser.add_argument("--out", type=Path, default=REPO / "loadtest/results/make-run")
    parser.add_argument("--append", action="store_true", help="add to an existing results.json")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "results.json"
    rows: list[dict[str, Any]] = []
    if args.append and path.exists():
        rows = json.loads(path.read_text())["rows"]
    for mode in args.modes:
        stack = Stack(args.repo, mode, args.out / f"{args.label.replace(' ', '_')}-{mode}.log")
        try:
            stack.wait_ready()
            asyncio.run(drive(workload(2), 2, 8))  # warm-up, not measured
            for concurrency in args.concurrency:
                requests = max(args.min_requests, args.requests_per_slot * concurrency)
                row = {
                    "checkout": args.label,
                    "mode": mode,
                    **measure(concurrency, requests, args.max_tokens),
                }
                print(json.dumps(row), flush=True)
                rows.append(row)
            if args.prefill:
                row = {
                    "checkout": args.label,
                    "mode": mode,
                    "prefill": measure_prefill(args.prefill_repeats),
                }
                print(json.dumps(row), flush=True)
                rows.append(row)
        finally:
            stack.stop()
    facts = {
        **machine_facts(),
        # make run's split of this machine's cores (this checkout; older ones took all)
        "service_torch_threads": {
            mode: {r: colocated_threads(r, get_mode(mode)) for r in ("cloud", "edge")}
            for mode in args.modes
        },
        # What the services' default (auto) resolves to here, unless the environment sets it.
        "service_dtype": {role: service_precision(role) for role in ("cloud", "edge")},
    }
    config = {k: str(v) for k, v in vars(args).items() if k not in ("out", "append")}
    path.write_text(json.dumps({"machine": facts, "config": config, "rows": rows}, indent=1))
    (args.out / "results.md").write_text(
        f"machine: {json.dumps(facts)}\n\n" + table(rows) + "\n\n"
        + "\n".join(json.dumps(r) for r in rows if "prefill" in r) + "\n"
    )  # fmt: skip
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
