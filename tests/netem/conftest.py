"""Fixtures for tests that need real network namespaces (root): a bare testbed — two
namespaces joined by a veth, nothing shaped — destroyed after the test."""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Iterator

import pytest

from loadtest.testbed import Testbed, TestbedLayout


def netns_unavailable_reason() -> str | None:
    """Why namespace tests cannot run here, or None when they can."""
    if os.geteuid() != 0:
        return "needs root (ip netns add, tc)"
    probe = f"asymspec-probe-{uuid.uuid4().hex[:6]}"
    added = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if added.returncode != 0:
        return f"ip netns add failed: {added.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


@pytest.fixture(scope="session")
def netns_ok() -> None:
    reason = netns_unavailable_reason()
    if reason is not None:
        pytest.skip(reason)


@pytest.fixture
def bare_testbed(netns_ok: None) -> Iterator[Testbed]:
    bed = Testbed(TestbedLayout.new(prefix="asymspec-test"))
    bed.create()
    try:
        yield bed
    finally:
        bed.destroy()


def netns_names() -> set[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    return {line.split()[0] for line in listed.stdout.splitlines() if line.strip()}
