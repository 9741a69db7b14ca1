"""The GPU check runs end to end on the CPU with a small model, so it cannot rot on
machines where no GPU is lent (its correctness checks must pass there too)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
def test_the_gpu_check_runs_on_the_cpu(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "loadtest.gpu_check", "--device", "cpu", "--small"]
    done = subprocess.run([*command, "--out", str(tmp_path)], capture_output=True, timeout=600)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    result = json.loads((tmp_path / "results.json").read_text())
    assert result["engine"]["ok"] and result["sampling"]["ok"]
    assert result["cost"]["verify_16x5_ms"] > 0 and result["cost"]["decode_16x1_ms"] > 0


def test_without_a_gpu_it_says_so() -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the check would run")
    command = [sys.executable, "-m", "loadtest.gpu_check"]
    done = subprocess.run(command, capture_output=True, timeout=120)
    assert done.returncode == 2 and b"no CUDA device" in done.stderr
