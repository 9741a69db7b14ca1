"""Multi-round agent conversations and single-turn chat against `make run`'s services.

    .venv/bin/python -m loadtest.bench_agent [--variants target-only asymspec asymspec-nosuffix]
        [--concurrency 1 8] [--temperatures 0 0.7] [--per-kind 2] [--max-tokens 128]
        [--dtype float32] [--out loadtest/results/agent]

For each variant it starts ``scripts/run_local.sh`` as ``make run`` does (``make_run_stack`` of
``bench_make_run.py``), with the mode and any extra edge settings the variant names; then
replays held-out agent conversations (``loadtest.conversations``) round by round, the
model's own answers going into the history, ``C`` conversations at a time, and reports
completion tokens per second of wall time, mean accepted tokens per block, the share of
blocks the suffix drafter made, and TTFT per round. ``--workloads chat`` sends single-turn
chat (the everyday chat prompts) where nothing repeats, on stacks that have served nothing
else (each edge's acceptance estimates carry over from one workload to the next). Greedy
answers are kept, so that variants can be compared token for token (``greedy_identical``);
``--dtype float32`` runs both services in float32, where greedy speculation must equal
target-only exactly.
Results: ``results.json`` (rows and the greedy answers) and ``results.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from asymspec_engine.embedded import EMBEDDED_DRAFT
from asymspec_engine.hardware import machine_facts
from asymspec_engine.llamacpp import ENGINE_GGUF
from asymspec_engine.loading import resolve_model
from loadtest.bench_cpu import llama_server
from loadtest.conversations import Conversation, agent_conversations
from loadtest.prompts import chat_prompts
from loadtest.server_process import ServerProcess, stream_chat

REPO = Path(__file__).resolve().parents[1]


def metric_sum(url: str, name: str) -> float:
    """A Prometheus counter of a service, summed over its labels."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))


# name -> (mode, extra edge settings)
VARIANTS: dict[str, tuple[str, dict[str, str]]] = {
    "target-only": ("target-only", {}),
    "asymspec": ("asymspec", {}),
    "asymspec-nosuffix": ("asymspec", {"ASYMSPEC_EDGE_SUFFIX_DRAFTING": "false"}),
    "target-only-noreuse": ("target-only", {"ASYMSPEC_CLOUD_PREFIX_REUSE": "false"}),
    "asymspec-noreuse": (
        "asymspec",
        {"ASYMSPEC_CLOUD_PREFIX_REUSE": "false", "ASYMSPEC_EDGE_PREFIX_REUSE": "false"},
    ),
}
# What a user would run instead: llama-server on the target's GGUF (``bench_cpu``'s), alone,
# with its n-gram drafter, and with the embedded draft's GGUF as its draft model.
LLAMA_SERVER_VARIANTS: dict[str, list[str]] = {
    "llama-server": [],
    "llama-server-ngram": ["--spec-type", "ngram-mod"],
    "llama-server-draft": ["--spec-type", "draft-simple", "-md", "{draft_gguf}"],
}
SECRET = "agent-bench-secret"


def make_run_stack(mode: str, extra: dict[str, str], edge_port: int, log: Path) -> ServerProcess:
    """``scripts/run_local.sh`` on its own ports, in its own process group. Every variant's
    stack runs side by side, so that variants take turns within each measurement and a
    shared machine's background load falls on all of them alike."""
    env = {
        **extra, "ASYMSPEC_MODE": mode, "ASYMSPEC_SHARED_SECRET": SECRET,
        "ASYMSPEC_EDGE_PORT": str(edge_port), "ASYMSPEC_CLOUD_PORT": str(edge_port + 1),
    }  # fmt: skip
    return ServerProcess(mode, ["bash", "scripts/run_local.sh"], env, edge_port, log)


def start_variant(variant: str, port: int, log: Path) -> ServerProcess:
    if variant in VARIANTS:
        return make_run_stack(*VARIANTS[variant], port, log)
    draft_gguf = str(Path(resolve_model(EMBEDDED_DRAFT)) / ENGINE_GGUF)
    extra = [a.format(draft_gguf=draft_gguf) for a in LLAMA_SERVER_VARIANTS[variant]]
    return llama_server(log, port, variant, ["--metrics", *extra])


COUNTERS = (
    "asymspec_spec_decode_num_accepted_tokens_total",
    "asymspec_spec_decode_num_drafts_total",
    "asymspec_spec_decode_num_suffix_drafts_total",
    "asymspec_spec_decode_num_suffix_accepted_tokens_total",
    "asymspec_cloud_decoded_tokens_total",
    "uplink_bytes",  # asymspec_link_bytes_total{direction="uplink"}
)
_UPLINK = re.compile(r'^asymspec_link_bytes_total\{[^}]*direction="uplink"[^}]*\} (\S+)$', re.M)


async def chat_turn(
    client: httpx.AsyncClient,
    messages: list[dict[str, str]],
    seed: int,
    max_tokens: int,
    temperature: float,
) -> dict[str, Any]:
    body = {"model": "asymspec", "messages": messages, "max_tokens": max_tokens}
    chat = await stream_chat(client, {**body, "temperature": temperature, "seed": seed})
    return {"content": chat.content, "tokens": chat.tokens, "ttft_s": chat.ttft_s}


async def replay(
    client: httpx.AsyncClient,
    conversation: Conversation,
    seed: int,
    max_tokens: int,
    temperature: float,
) -> list[dict[str, Any]]:
    """Every round of one conversation, each answer appended to the history."""
    messages = conversation.first_messages()
    rounds = []
    for i, turn in enumerate(conversation.turns):
        if i:
            messages.append({"role": "user", "content": turn})
        answer = await chat_turn(client, messages, seed + i, max_tokens, temperature)
        messages.append({"role": "assistant", "content": answer["content"]})
        rounds.append(answer)
    return rounds


def counters(url: str) -> dict[str, float]:
    """The edge's counters (``uplink_bytes``: the link bytes it sent); zeros for a server
    that has none of them (llama-server)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    if "asymspec_" not in text:
        return dict.fromkeys(COUNTERS, 0.0)
    out = {name: metric_sum(url, name) for name in COUNTERS[:-1]}
    out["uplink_bytes"] = sum(float(v) for v in _UPLINK.findall(text))
    return out


def measure(
    url: str,
    conversations: list[Conversation],
    concurrency: int,
    max_tokens: int,
    temperature: float,
) -> tuple[dict[str, Any], list[list[str]]]:
    before = counters(url)

    async def run() -> tuple[list[list[dict[str, Any]]], float]:
        limit = asyncio.Semaphore(concurrency)
        # a connection per request: llama-server closes idle keep-alive connections
        fresh = httpx.Limits(max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=url, timeout=900, limits=fresh) as client:

            async def limited(i: int, conv: Conversation) -> list[dict[str, Any]]:
                async with limit:
                    return await replay(client, conv, 1000 * i, max_tokens, temperature)

            started = time.perf_counter()
            out = await asyncio.gather(*(limited(i, c) for i, c in enumerate(conversations)))
            return out, time.perf_counter() - started

    results, wall_s = asyncio.run(run())
    after = counters(url)
    delta = {name: after[name] - before[name] for name in COUNTERS}
    tokens = sum(r["tokens"] for rounds in results for r in rounds)
    ttft_sum_s = sum(r["ttft_s"] for rounds in results for r in rounds)
    blocks = delta["asymspec_spec_decode_num_drafts_total"]
    ttft = {
        f"ttft_round{k + 1}_p50_s": round(statistics.median(rs[k]["ttft_s"] for rs in results), 3)
        for k in range(min(len(rs) for rs in results))
    }
    row = {
        "concurrency": concurrency,
        "temperature": temperature,
        "conversations": len(conversations),
        "rounds": sum(len(rs) for rs in results),
        "completion_tokens": tokens,
        "wall_s": round(wall_s, 2),
        "throughput_tok_s": round(tokens / wall_s, 2),
        # At C = 1 the rounds run one after another: the wall time less every round's wait
        # for its first token is the decoding time (where speculation acts; prefill is not).
        "ttft_sum_s": round(ttft_sum_s, 2),
        "decode_tok_s": (round(tokens / (wall_s - ttft_sum_s), 2) if concurrency == 1 else None),
        "blocks": int(blocks),
        "accepted_per_block": (
            round(delta["asymspec_spec_decode_num_accepted_tokens_total"] / blocks, 3)
            if blocks
            else None
        ),
        "suffix_blocks": int(delta["asymspec_spec_decode_num_suffix_drafts_total"]),
        "suffix_accepted_tokens": int(
            delta["asymspec_spec_decode_num_suffix_accepted_tokens_total"]
        ),
        "cloud_decoded_tokens": int(delta["asymspec_cloud_decoded_tokens_total"]),
        "uplink_bytes_per_token": round(delta[COUNTERS[-1]] / tokens, 2) if tokens else None,
        **ttft,
    }
    return row, [[r["content"] for r in rounds] for rounds in results]


def chat_conversations() -> list[Conversation]:
    """Single-turn everyday chat, where nothing repeats: the drafter must not cost here."""
    out = []
    for i, messages in enumerate(chat_prompts()):
        system = next((m["content"] for m in messages if m["role"] == "system"), None)
        users = tuple(m["content"] for m in messages if m["role"] == "user")[:1]
        out.append(Conversation(f"chat/{i}", "summarise", users, system))
    return out


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| workload | variant | C | T | tok/s | vs target-only | accepted/block | suffix blocks |"
    )
    lines = [head, "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        base = next(
            (
                b["throughput_tok_s"]
                for b in rows
                if b["variant"] == "target-only"
                and (b["workload"], b["concurrency"], b["temperature"])
                == (r["workload"], r["concurrency"], r["temperature"])
            ),
            None,
        )
        ratio = f"{r['throughput_tok_s'] / base:.2f}x" if base else ""
        lines.append(
            f"| {r['workload']} | {r['variant']} | {r['concurrency']} | {r['temperature']} | "
            f"{r['throughput_tok_s']} | {ratio} | {r['accepted_per_block'] or ''} | "
            f"{r['suffix_blocks']}/{r['blocks']} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--variants",
        nargs="+",
        default=list(VARIANTS),
        choices=[*VARIANTS, *LLAMA_SERVER_VARIANTS],
    )
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1])
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7])
    parser.add_argument("--per-kind", type=int, default=2, help="held-out conversations a kind")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument(
        "--workloads",
        nargs="+",
        default=["agent"],
        choices=["agent", "chat"],
        help="agent: held-out conversations; chat: single-turn everyday chat",
    )
    parser.add_argument("--chat-prompts", type=int, default=8, help="chat prompts (of 8)")
    parser.add_argument(
        "--reply-timeout-s",
        type=float,
        default=None,
        help="the edge's cloud_reply_timeout_s (a shared, loaded machine prefills slowly)",
    )
    parser.add_argument("--dtype", default=None, help="both services' dtype (default: auto)")
    parser.add_argument("--port", type=int, default=18400, help="the edge's; the cloud's is +1")
    parser.add_argument("--out", type=Path, default=REPO / "loadtest/results/agent")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.dtype:
        os.environ["ASYMSPEC_CLOUD_DTYPE"] = os.environ["ASYMSPEC_EDGE_DTYPE"] = args.dtype
    if args.reply_timeout_s:
        os.environ["ASYMSPEC_EDGE_CLOUD_REPLY_TIMEOUT_S"] = str(args.reply_timeout_s)
    available = {
        "agent": lambda: agent_conversations("heldout", args.per_kind),
        "chat": lambda: chat_conversations()[: args.chat_prompts],
    }
    workloads = {name: available[name]() for name in args.workloads}
    rows: list[dict[str, Any]] = []
    answers: dict[str, Any] = {}
    stacks = {
        v: start_variant(v, args.port + 2 * i, args.out / f"{v}.log")
        for i, v in enumerate(args.variants)
    }
    try:
        for stack in stacks.values():
            stack.wait_ready()
        for stack in stacks.values():  # warm-up, not measured
            measure(stack.url, agent_conversations("train", 1)[:1], 1, 16, 0.0)
        for workload, conversations in workloads.items():
            for temperature in args.temperatures:
                for concurrency in args.concurrency:
                    for variant, stack in stacks.items():  # take turns, cell by cell
                        row, texts = measure(
                            stack.url, conversations, concurrency, args.max_tokens, temperature
                        )
                        row = {"workload": workload, "variant": variant, **row}
                        print(json.dumps(row), flush=True)
                        rows.append(row)
                        if temperature == 0.0:
                            answers[f"{workload}/{variant}/C{concurrency}"] = texts
    finally:
        for stack in stacks.values():
            stack.stop()
    identical = {
        key: value == answers[key.replace(key.split("/")[1], "target-only", 1)]
        for key, value in answers.items()
        if "target-only" not in key and key.replace(key.split("/")[1], "target-only", 1) in answers
    }
    config = {k: str(v) for k, v in vars(args).items() if k != "out"}
    config["command"] = " ".join(sys.argv)
    result = {
        "machine": machine_facts(),
        "config": config,
        "rows": rows,
        "greedy_identical": identical,
        "greedy_answers": answers,
    }
    (args.out / "results.json").write_text(json.dumps(result, indent=1))
    (args.out / "results.md").write_text(
        f"command: `{config['command']}`\n\nmachine: {json.dumps(machine_facts())}\n\n"
        f"{table(rows)}\n\ngreedy output identical to target-only: {json.dumps(identical)}\n"
    )
    print(table(rows))
    print("greedy identical:", identical)
    return 0


if __name__ == "__main__":
    sys.exit(main())
