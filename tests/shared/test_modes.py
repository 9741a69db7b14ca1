"""asymspec.modes: the named behaviour predicates of every mode."""

from __future__ import annotations

from asymspec.modes import get_mode


def test_mode_predicates_follow_the_knobs() -> None:
    """The named predicates the services branch on, mode by mode (the README's table)."""
    expected = {
        # mode: (needs_cloud, target_only, draft_only, full rows, top-K, alone, ahead, rounds,
        # pipeline)
        "asymspec": (True, False, False, False, True, False, False, False, True),
        "no-topk": (True, False, False, False, False, False, False, False, True),
        "no-pipeline": (True, False, False, False, True, False, False, True, False),
        "runahead": (True, False, False, False, True, False, True, True, False),
        "full-upload": (True, False, False, True, False, False, False, False, True),
        "pipeinfer": (True, False, False, True, False, False, True, True, False),
        "standard": (True, False, False, True, False, True, False, False, False),
        "target-only": (True, True, False, False, False, False, False, False, False),
        "draft-only": (False, False, True, False, False, False, False, False, False),
    }
    for name, row in expected.items():
        m = get_mode(name)
        got = (
            m.needs_cloud, m.is_target_only, m.is_draft_only, m.uploads_full_rows,
            m.uses_topk, m.waits_alone, m.runs_ahead, m.drafts_in_rounds, m.pipelines,
        )  # fmt: skip
        assert got == row, name
