"""What a benchmark phase sends: HumanEval prompts, fixed seeds, OpenAI completion bodies;
or, for the ``agent`` workload, multi-round conversations (``loadtest.conversations``) as
chat bodies, replayed round by round (``loadgen.run_conversations``).

Measured requests use the held-out split (never seen by draft training), warm-up requests
the train split, so every mode sees the same measured prompts with the same seeds and the
warm-up never overlaps them. Request ``i`` of a phase gets ``seed = base_seed + i``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from loadtest.conversations import KINDS, Conversation, agent_conversations
from loadtest.prompts import Split, humaneval_prompts

SERVED_MODEL = "asymspec"  # the edge's default served_model_name


@dataclass(frozen=True)
class Sampling:
    max_tokens: int = 64
    temperature: float = 0.7
    # vLLM's benchmark convention: every request generates exactly max_tokens, so modes are
    # compared on equal work rather than on where each happened to sample an end token.
    ignore_eos: bool = True
    fidelity_budget: float | None = None  # None: the edge's default (0 = exact)
    num_draft_tokens: int | None = None  # None: the edge's default γ


def completion_body(prompt: str, seed: int, sampling: Sampling) -> dict[str, Any]:
    """One streaming /v1/completions body whose last chunk carries `usage`."""
    body: dict[str, Any] = {
        "model": SERVED_MODEL,
        "prompt": prompt,
        "max_tokens": sampling.max_tokens,
        "temperature": sampling.temperature,
        "seed": seed,
        "ignore_eos": sampling.ignore_eos,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if sampling.fidelity_budget is not None:
        body["fidelity_budget"] = sampling.fidelity_budget
    if sampling.num_draft_tokens is not None:
        body["num_draft_tokens"] = sampling.num_draft_tokens
    return body


def phase_bodies(
    prompts: Sequence[str], n: int, sampling: Sampling, base_seed: int
) -> list[dict[str, Any]]:
    """``n`` bodies cycling through ``prompts`` in order (request i: prompt i mod len)."""
    if not prompts:
        raise ValueError("no prompts")
    return [completion_body(prompts[i % len(prompts)], base_seed + i, sampling) for i in range(n)]


def measured_bodies(n: int, sampling: Sampling, base_seed: int) -> list[dict[str, Any]]:
    return phase_bodies(humaneval_prompts("heldout"), n, sampling, base_seed)


def warmup_bodies(n: int, sampling: Sampling, base_seed: int) -> list[dict[str, Any]]:
    # Seeds far from the measured ones, so no warm-up request repeats a measured draw.
    return phase_bodies(humaneval_prompts("train"), n, sampling, base_seed + 1_000_000)


WORKLOADS = ("humaneval", "agent")


def chat_body(messages: list[dict[str, str]], seed: int, sampling: Sampling) -> dict[str, Any]:
    """A completion body turned into a chat body with these ``messages``."""
    body = completion_body("", seed, sampling)
    del body["prompt"]
    return {**body, "messages": messages}


def conversation_bodies(
    conversation: Conversation, seed: int, sampling: Sampling
) -> list[dict[str, Any]]:
    """One chat body per round: the opening messages, then each new user turn alone."""
    rounds = [conversation.first_messages()]
    rounds += [[{"role": "user", "content": turn}] for turn in conversation.turns[1:]]
    return [chat_body(messages, seed + k, sampling) for k, messages in enumerate(rounds)]


def conversations_of(
    split: Split, n: int, sampling: Sampling, base_seed: int
) -> list[list[dict[str, Any]]]:
    """``n`` conversations of ``split``, the kinds interleaved; conversation i's round k
    gets seed base_seed + 100 i + k."""
    per_kind = -(-n // len(KINDS))
    chosen = agent_conversations(split, per_kind)[:n]
    return [conversation_bodies(c, base_seed + 100 * i, sampling) for i, c in enumerate(chosen)]


def measured_conversations(
    n: int, sampling: Sampling, base_seed: int
) -> list[list[dict[str, Any]]]:
    return conversations_of("heldout", n, sampling, base_seed)


def warmup_conversations(n: int, sampling: Sampling, base_seed: int) -> list[list[dict[str, Any]]]:
    return conversations_of("train", n, sampling, base_seed + 1_000_000)


def with_fields(bodies: Sequence[Mapping[str, Any]], **fields: Any) -> list[dict[str, Any]]:
    """Copies of ``bodies`` with ``fields`` set (e.g. a per-request γ)."""
    return [{**body, **fields} for body in bodies]
