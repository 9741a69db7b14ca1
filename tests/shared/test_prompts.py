"""The workload prompts: HumanEval split sizes, disjointness, determinism, rendering."""

from __future__ import annotations

from typing import Any

import pytest

from asymspec import prompts


def test_all_problems_load_in_file_order() -> None:
    problems = prompts.humaneval_problems("all")
    assert len(problems) == prompts.HUMANEVAL_PROBLEM_COUNT
    assert [p.index for p in problems] == list(range(164))
    assert problems[0].task_id == "HumanEval/0"
    assert all(p.prompt.strip() for p in problems)


def test_split_counts_and_disjointness() -> None:
    train = prompts.humaneval_problems("train")
    heldout = prompts.humaneval_problems("heldout")
    assert len(heldout) >= 30
    assert len(train) + len(heldout) == 164
    assert {p.task_id for p in train}.isdisjoint({p.task_id for p in heldout})
    assert all(p.index % 5 == 0 for p in heldout)  # the documented rule, pinned


def test_split_is_deterministic() -> None:
    first = prompts.humaneval_prompts("heldout")
    prompts._all_problems.cache_clear()  # re-read the file: same order, same split
    assert prompts.humaneval_prompts("heldout") == first


def test_unknown_split_is_an_error() -> None:
    with pytest.raises(ValueError, match="unknown split"):
        prompts.humaneval_problems("test")  # type: ignore[arg-type]


def test_chat_prompts_are_fresh_copies() -> None:
    conversations = prompts.chat_prompts()
    assert len(conversations) >= 3
    assert all(m["role"] in {"system", "user"} for c in conversations for m in c)
    conversations[0].append({"role": "assistant", "content": "x"})
    assert len(prompts.chat_prompts()[0]) == 1


class _FakeTokenizer:
    """Renders messages as `role: content` lines, like a minimal chat template."""

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> str:
        assert kwargs == {"tokenize": False, "add_generation_prompt": True}
        return "".join(f"{m['role']}: {m['content']}\n" for m in conversation) + "assistant: "


def test_render_completion_is_the_prompt_itself() -> None:
    code = prompts.humaneval_prompts("train")[0]
    assert prompts.render_prompt(code, "completion") == code


def test_render_chat_wraps_code_and_applies_template() -> None:
    code = prompts.humaneval_prompts("train")[0]
    text = prompts.render_prompt(code, "chat", _FakeTokenizer())
    assert text.startswith("user: " + prompts.CHAT_INSTRUCTION)
    assert code in text
    assert text.endswith("assistant: ")


def test_render_rejects_impossible_combinations() -> None:
    with pytest.raises(ValueError, match="no raw completion form"):
        prompts.render_prompt(prompts.chat_prompts()[0], "completion")
    with pytest.raises(ValueError, match="needs the tokenizer"):
        prompts.render_prompt("def f():", "chat")
