"""What the machine can do for a forward: the device, the torch engine's dtype, and the
facts a result file records (CPU model and flags, threads), because machines here differ.

The torch engine runs bf16 on CUDA and float32 on CPUs, where it is the exact reference
(the llama.cpp engine is the fast CPU path). ``bfloat16`` can be forced on a CPU.
"""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from asymspec.modes import Mode

DtypeName = Literal["auto", "bfloat16", "float32"]
BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")


def pick_device() -> str:
    """CUDA when a GPU is visible, else CPU."""
    return "cuda" if torch.cuda.is_available() else "cpu"


@functools.cache
def _cpuinfo_field(name: str) -> str | None:
    """The first CPU's ``name`` line of /proc/cpuinfo (None where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(name):
            return line.split(":", 1)[1].strip()
    return None


def cpu_flags() -> set[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    return set((_cpuinfo_field("flags") or "").split())


def cpu_model() -> str:
    return _cpuinfo_field("model name") or platform.processor() or "unknown"


def cpu_has_native_bf16() -> bool:
    return bool(cpu_flags() & set(BF16_CPU_FLAGS))


def cpu_has_amx() -> bool:
    """AMX tiles: bf16 products of up to 16 rows cost about one row's (Sapphire Rapids on)."""
    return "amx_bf16" in cpu_flags()


@dataclass(frozen=True)
class Precision:
    """What a torch forward computes in: the model's dtype (weights and activations)."""

    dtype: torch.dtype

    def __str__(self) -> str:
        return str(self.dtype)


def resolve_precision(name: DtypeName | str, device: str | torch.device) -> Precision:
    """The precision a setting names. ``auto``: bf16 on CUDA, float32 elsewhere."""
    if name == "bfloat16":
        return Precision(torch.bfloat16)
    if name == "float32":
        return Precision(torch.float32)
    if name != "auto":
        raise ValueError(f"dtype must be auto, bfloat16 or float32, got {name!r}")
    return Precision(torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32)


def resolve_dtype(name: DtypeName | str, device: str | torch.device) -> torch.dtype:
    """The model dtype of ``resolve_precision`` (float16 weights live in a float32 model)."""
    return resolve_precision(name, device).dtype


Role = Literal["edge", "cloud"]


def colocated_threads(role: Role, mode: Mode, cpus: int | None = None) -> int:
    """torch threads for one of the two services when both share this host (``make run``,
    the compose stack). When both run models, the cloud's target forward is the bottleneck,
    so it gets most cores; the draft is ~8x smaller and gets a quarter (at least one); on 2
    cores: 1 + 1. Giving both every core made their OpenMP threads fight (4x slower at 16
    chats). When only one side runs a model (target-only: the cloud; draft-only: the edge)
    that side takes every core and the idle one keeps one."""
    total = cpus or os.cpu_count() or 1
    if mode.is_target_only or mode.is_draft_only:
        busy: Role = "cloud" if mode.is_target_only else "edge"
        return total if role == busy else 1
    edge = max(1, total // 4)
    return edge if role == "edge" else max(1, total - edge)


@dataclass(frozen=True)
class ForwardThreads:
    """The cloud's torch threads per forward on a host it shares with the edge: ``solo``
    while at most one session is open (the edge then waits for that session's verdict and
    leaves its core idle) or the round only decodes (the edge's requests all wait for the
    cloud's tokens), ``shared`` otherwise (the edge drafts other sessions meanwhile).
    Measured with ``make run`` on 2 cores, the model loaded on its forward thread
    (2026-12-03, loadtest/results/model-thread/): at one chat 2 threads made asymspec 39.6
    tok/s against 31.8 with 1; at 16 chats 2 threads were slower (107.9 vs 143.3 tok/s:
    the cloud's spinning OpenMP worker takes the core the edge drafts on)."""

    shared: int
    solo: int

    def for_round(self, open_sessions: int, cloud_decodes_alone: bool) -> int:
        """``cloud_decodes_alone``: the round decodes and verifies no block, so the edge,
        whose requests wait for those tokens, is not drafting (target-only mode, or a
        colocated edge that paused speculation at a large batch)."""
        return self.solo if open_sessions <= 1 or cloud_decodes_alone else self.shared


def machine_facts() -> dict[str, object]:
    """What every result file records about the machine it ran on."""
    flags = cpu_flags()
    return {
        "cpu_model": cpu_model(),
        "cpu_bf16_flags": sorted(flags & set(BF16_CPU_FLAGS)),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
