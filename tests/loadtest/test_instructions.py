"""The templated chat instructions: a fixed order, and a split by subject."""

from __future__ import annotations

import pytest

from loadtest.instructions import instructions, is_heldout


def test_the_split_is_by_subject_and_covers_everything() -> None:
    train, heldout, every = instructions("train"), instructions("heldout"), instructions("all")
    assert len(train) + len(heldout) == len(every) > 1000
    train_subjects = {i.subject for i in train}
    assert train_subjects.isdisjoint({i.subject for i in heldout})  # no topic in both
    assert all(is_heldout(i.subject) for i in heldout)
    assert {i.kind for i in heldout} == {i.kind for i in train}  # every kind evaluated
    assert len({i.text for i in every}) == len(every)  # no instruction twice


def test_the_order_is_fixed() -> None:
    first = [i.text for i in instructions("train")]
    assert first == [i.text for i in instructions("train")]
    assert first[0] == "Explain photosynthesis in simple terms."


def test_unknown_split() -> None:
    with pytest.raises(ValueError, match="unknown split"):
        instructions("valid")  # type: ignore[arg-type]
