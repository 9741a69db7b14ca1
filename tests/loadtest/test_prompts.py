"""The workload prompts: HumanEval split sizes, disjointness, determinism, rendering."""

from __future__ import annotations

import zlib
from typing import Any

import pytest

from loadtest import prompts


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


def test_source_prompts_are_functions_cut_after_their_docstring() -> None:
    train, heldout = prompts.source_prompts("train"), prompts.source_prompts("heldout")
    assert len(train) > 1000 and len(heldout) > 200
    # crc32 % 5: about a fifth held out
    assert 0.15 < len(heldout) / (len(train) + len(heldout)) < 0.25
    assert set(train).isdisjoint(heldout)  # nothing held out was trained on
    assert len(set(heldout)) == len(heldout)
    for text in train[:200]:
        first, *rest = text.splitlines()
        assert first.startswith(("def ", "async def ")), first
        assert rest and text.rstrip()[-1] in "\"'", text[-40:]  # ends with its docstring


def test_source_split_is_deterministic_and_by_key() -> None:
    first = prompts.source_prompts("heldout")
    prompts._all_source_prompts.cache_clear()
    assert prompts.source_prompts("heldout") == first
    key = "json/decoder.py:py_scanstring"
    assert prompts.is_source_heldout(key) == (zlib.crc32(key.encode()) % 5 == 0)
    with pytest.raises(ValueError, match="unknown split"):
        prompts.source_prompts("test")  # type: ignore[arg-type]


def test_function_prompts_skip_short_docstrings_and_bodiless_functions() -> None:
    source = (
        "def documented(x):\n"
        '    """Return x doubled, which is what this long enough docstring says."""\n'
        "    return 2 * x\n\n"
        "def terse(x):\n"
        '    """Too short."""\n'
        "    return x\n\n"
        "def docstring_only():\n"
        '    """A docstring that is long enough but with no body after it at all."""\n\n'
        "class C:\n"
        "    def method(self):\n"
        '        """A method whose docstring is long enough to continue from here."""\n'
        "        return 1\n"
    )
    found = prompts._function_prompts("m.py", source)
    assert [p.key for p in found] == ["m.py:documented", "m.py:method"]
    assert found[1].prompt.startswith('def method(self):\n    """A method')  # dedented
    assert prompts._function_prompts("bad.py", "def (:") == []


def test_prose_prompts_are_docstring_openings_split_without_overlap() -> None:
    train, heldout = prompts.prose_prompts("train"), prompts.prose_prompts("heldout")
    assert len(train) > 300 and len(heldout) > 50
    assert set(train).isdisjoint(heldout)
    for text in train[:50]:
        assert (
            text.endswith(".")
            and prompts.PROSE_OPENING_CHARS < len(text) <= 2 * prompts.PROSE_OPENING_CHARS + 1
        )
        assert "\n" not in text  # one paragraph
    assert prompts.prose_prompts("train") == train  # deterministic
