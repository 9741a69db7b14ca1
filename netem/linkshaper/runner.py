"""Who executes the command lines: a subprocess (optionally inside a network namespace), or
a dry run that records and prints them (`--dry-run`: see what would be applied, no root)."""

from __future__ import annotations

import shlex
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, TextIO

COMMAND_TIMEOUT_S = 10.0


@dataclass(frozen=True, slots=True)
class CommandResult:
    argv: tuple[str, ...]
    returncode: int
    stderr: str
    stdout: str = ""

    @property
    def ok(self) -> bool:
        return self.returncode == 0


class CommandRunner(Protocol):
    def run(self, argv: Sequence[str]) -> CommandResult: ...


def netns_prefix(netns: str | None) -> list[str]:
    """`ip netns exec NAME` (empty for the current namespace)."""
    return ["ip", "netns", "exec", netns] if netns else []


@dataclass(frozen=True, slots=True)
class SubprocessRunner:
    """Runs each command, inside `netns` when given. A missing binary (no ethtool in a
    minimal image) is a failed command, not a crash: callers decide what is fatal."""

    netns: str | None = None

    def run(self, argv: Sequence[str]) -> CommandResult:
        full = [*netns_prefix(self.netns), *argv]
        try:
            done = subprocess.run(
                full, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, check=False
            )
        except FileNotFoundError as exc:
            return CommandResult(tuple(full), 127, str(exc))
        except subprocess.TimeoutExpired:
            return CommandResult(tuple(full), 124, f"timed out after {COMMAND_TIMEOUT_S} s")
        return CommandResult(tuple(full), done.returncode, done.stderr.strip(), done.stdout)


@dataclass(slots=True)
class DryRunRunner:
    """Succeeds at everything, keeps every command line and prints it as `+ tc ...`."""

    netns: str | None = None
    out: TextIO | None = field(default_factory=lambda: sys.stdout)
    commands: list[tuple[str, ...]] = field(default_factory=list)

    def run(self, argv: Sequence[str]) -> CommandResult:
        full = (*netns_prefix(self.netns), *argv)
        self.commands.append(full)
        if self.out is not None:
            print("+", shlex.join(full), file=self.out, flush=True)
        return CommandResult(full, 0, "")
