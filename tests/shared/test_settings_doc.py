"""docs/settings.md is what scripts/settings_doc.py prints from the settings classes, so the
reference cannot drift from the code (regenerate it when a setting changes)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_settings_page_is_generated_from_the_classes() -> None:
    spec = importlib.util.spec_from_file_location("settings_doc", REPO / "scripts/settings_doc.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    page = module.page()
    assert "`--engine` | `ASYMSPEC_CLOUD_ENGINE`" in page
    assert (REPO / "docs/settings.md").read_text() == page, (
        "run: .venv/bin/python scripts/settings_doc.py > docs/settings.md"
    )
