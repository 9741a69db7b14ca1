"""Multi-round agent conversations: the user turns of each, replayed round by round by a
client that puts the model's own earlier answers into the history (so the server, not
this module, decides what repeats).

Three kinds, as agents use a model:

- ``code-edit``: write a function (a HumanEval problem), then change it and show the whole
  function again, twice;
- ``tool-agent``: a shell agent reads observations (a directory listing, a file's source
  from the standard library, a JSON test report) and answers after each;
- ``summarise``: summarise a documentation text, then restructure the summary twice.

Splits follow ``loadtest.prompts``: a held-out conversation is built only from held-out
HumanEval problems and held-out standard-library texts, so evaluation never runs on what
the draft was trained or anything was tuned on.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass
from typing import Literal

from loadtest.prompts import Message, Split, humaneval_problems, prose_prompts, source_prompts

Kind = Literal["code-edit", "tool-agent", "summarise"]
KINDS: tuple[Kind, ...] = ("code-edit", "tool-agent", "summarise")

_AGENT_SYSTEM = (
    "You are a coding agent working in a shell. After each observation, say briefly what "
    "you learned and quote the lines that matter exactly."
)


@dataclass(frozen=True)
class Conversation:
    """One conversation: an optional system message and the user turns, in order."""

    name: str
    kind: Kind
    turns: tuple[str, ...]
    system: str | None = None

    def first_messages(self) -> list[Message]:
        system = [{"role": "system", "content": self.system}] if self.system else []
        return [*system, {"role": "user", "content": self.turns[0]}]


def _code_edit(index: int, prompt: str) -> Conversation:
    name = prompt.split("def ", 1)[-1].split("(", 1)[0].strip() if "def " in prompt else "f"
    return Conversation(
        f"code-edit/{index}",
        "code-edit",
        (
            f"Complete this Python function. Reply with the code only.\n\n```python\n{prompt}```",
            f"Rename `{name}` to `{name}_checked` and add type hints everywhere. "
            "Show the whole function again.",
            "Now raise a ValueError for invalid input at the top of the function. "
            "Show the whole function again, unchanged otherwise.",
        ),
    )


def _tool_agent(index: int, source: str) -> Conversation:
    name = source.split("def ", 1)[-1].split("(", 1)[0].strip() if "def " in source else "f"
    module = f"pkg{zlib.crc32(source.encode()) % 97}"
    listing = "\n".join(
        ["$ ls -l src/", f"-rw-r--r-- 1 dev dev 4210 {module}/core.py"]
        + [f"-rw-r--r-- 1 dev dev {1000 + 37 * i} {module}/part{i}.py" for i in range(3)]
    )
    report = {
        "tool": "run_tests",
        "passed": 41,
        "failed": [{"test": f"test_{name}", "file": f"{module}/core.py", "line": 88}],
        "error": f"AssertionError: {name}() returned None",
    }
    return Conversation(
        f"tool-agent/{index}",
        "tool-agent",
        (
            f"Task: find out why the test suite fails.\nObservation:\n{listing}",
            f"Observation:\n$ sed -n 80,120p {module}/core.py\n{source}",
            f"Observation:\n{json.dumps(report, indent=2)}\n"
            f"Quote the definition of `{name}` exactly as shown above, then explain the "
            "failure.",
        ),
        system=_AGENT_SYSTEM,
    )


def _summarise(index: int, text: str) -> Conversation:
    return Conversation(
        f"summarise/{index}",
        "summarise",
        (
            f"Summarise this text in three bullet points.\n\n{text}",
            "Restructure your summary as a Markdown table with columns Point and Detail.",
            "Now give the same table again, with a third column Example.",
        ),
    )


def agent_conversations(
    split: Split, per_kind: int, kinds: tuple[Kind, ...] = KINDS
) -> list[Conversation]:
    """``per_kind`` conversations of each kind from ``split``, interleaved by kind."""
    problems = humaneval_problems(split)
    sources = [s for s in source_prompts(split) if len(s) >= 200]
    texts = [t for t in prose_prompts(split) if len(t) >= 300]
    built: dict[Kind, list[Conversation]] = {
        "code-edit": [_code_edit(p.index, p.prompt) for p in problems[:per_kind]],
        "tool-agent": [_tool_agent(i, s) for i, s in enumerate(sources[:per_kind])],
        "summarise": [_summarise(i, t) for i, t in enumerate(texts[:per_kind])],
    }
    for kind in kinds:
        if len(built[kind]) < per_kind:
            raise ValueError(f"{split} has only {len(built[kind])} {kind} conversations")
    return [built[kind][i] for i in range(per_kind) for kind in kinds]
