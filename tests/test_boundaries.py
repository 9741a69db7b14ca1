"""Which package may import which, read from the source with ``ast`` (no imports run).

The protocol package (``shared/asymspec``) holds the protocol: it imports neither the
engine, the services, the benchmark, the link sidecar nor the tests. The engine serves
the services and imports neither them nor the benchmark or tests. Nothing outside tests/
imports the tests: the helpers tests and benchmarks share live in ``loadtest``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

FORBIDDEN: dict[str, set[str]] = {
    "shared/asymspec": {
        "asymspec_engine",
        "edge_gateway",
        "cloud_verifier",
        "loadtest",
        "netem",
        "tests",
    },
    "shared/asymspec_engine": {"edge_gateway", "cloud_verifier", "loadtest", "netem", "tests"},
    "services": {"loadtest", "netem", "tests"},
    "netem": {"asymspec_engine", "edge_gateway", "cloud_verifier", "loadtest", "tests"},
    "loadtest": {"tests"},
    "scripts": {"tests"},
}


def imported_packages(path: Path) -> set[str]:
    """The top-level names of every absolute import in one file, nested ones included."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("folder", sorted(FORBIDDEN))
def test_imports_point_the_right_way(folder: str) -> None:
    files = sorted((REPO / folder).rglob("*.py"))
    assert files, folder
    wrong = {
        str(path.relative_to(REPO)): sorted(imported_packages(path) & FORBIDDEN[folder])
        for path in files
    }
    assert {path: names for path, names in wrong.items() if names} == {}


def test_the_parser_sees_nested_and_from_imports(tmp_path: Path) -> None:
    source = tmp_path / "module.py"
    source.write_text(
        "import os.path\nfrom tests.x import y\nfrom . import sibling\n"
        "def f():\n    import netem.tc\n"
    )
    assert imported_packages(source) == {"os", "tests", "netem"}
