"""Acceptance and throughput with structured output on, against the same requests free.

Real processes on loopback (a cloud verifier and an asymspec edge, float32, one torch
thread each). For each held-out JSON schema (``loadtest/json_schemas.py``) it sends one
chat request under the schema, then the same request without it for as many tokens as the
constrained answer had (``ignore_eos``), one at a time, and
reports per mode of output: accepted draft tokens per block, the acceptance rate (accepted
/ drafted), and generated tokens per second of wall time.

    .venv/bin/python -m loadtest.bench_structured                    # the tiny pair
    .venv/bin/python -m loadtest.bench_structured --num-draft-tokens 4 --temperature 0
    .venv/bin/python -m loadtest.bench_structured --target T --draft D
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from loadtest.json_schemas import SCHEMAS, USER
from loadtest.processes import cloud_env, edge_env, free_port, running
from loadtest.tiny_models import save_tiny_pair


def ask(url: str, body: dict[str, Any]) -> tuple[dict[str, Any], float]:
    started = time.perf_counter()
    response = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600)
    response.raise_for_status()
    return response.json(), time.perf_counter() - started


def summary(runs: list[tuple[dict[str, Any], float]]) -> dict[str, float]:
    stats = [r["metrics"]["speculative_decoding"] for r, _ in runs]
    blocks = sum(s["num_drafts"] for s in stats)
    drafted = sum(s["num_draft_tokens"] for s in stats)
    accepted = sum(s["num_accepted_tokens"] for s in stats)
    tokens = sum(r["usage"]["completion_tokens"] for r, _ in runs)
    return {
        "accepted_per_block": accepted / blocks,
        "acceptance_rate": accepted / drafted,
        "tokens_per_s": tokens / sum(s for _, s in runs),
        "tokens": tokens,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", type=Path, help="target checkpoint (default: tiny pair)")
    parser.add_argument("--draft", type=Path, help="draft checkpoint (default: tiny pair)")
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--num-draft-tokens", type=int, help="pin γ (default: the server's)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        target, draft = (
            (args.target, args.draft) if args.target else save_tiny_pair(Path(tmp) / "pair")
        )
        cloud_port, edge_port = free_port(), free_port()
        logs = Path(tmp)
        with (
            running("cloud_verifier", cloud_port, cloud_env(target, cloud_port), logs),
            running(
                "edge_gateway",
                edge_port,
                edge_env(draft, edge_port, cloud_port, "asymspec", max_model_len="1024"),
                logs,
            ) as edge,
        ):
            base: dict[str, Any] = {
                "model": "asymspec", "messages": USER, "temperature": args.temperature,
            }  # fmt: skip
            if args.num_draft_tokens is not None:
                base["num_draft_tokens"] = args.num_draft_tokens
            ask(edge.url, {**base, "max_tokens": 4})  # warm-up
            constrained, free = [], []
            for seed, schema in enumerate(SCHEMAS):
                fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
                answer = ask(
                    edge.url, {**base, "seed": seed, "max_tokens": 300, "response_format": fmt}
                )
                constrained.append(answer)
                length = answer[0]["usage"]["completion_tokens"]
                free.append(
                    ask(edge.url, {**base, "seed": seed, "max_tokens": length, "ignore_eos": True})
                )
    report = {"constrained": summary(constrained), "free": summary(free)}
    settings = {"temperature": args.temperature, "num_draft_tokens": args.num_draft_tokens}
    print(json.dumps({**settings, **report}, indent=2))


if __name__ == "__main__":
    main()
