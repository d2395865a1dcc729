"""bench/gpu_check.sh keeps working where CI runs: on a CPU machine it says it skips the CUDA
steps, runs the matmul table against cpu-gloo, writes its summary and exits 0."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU mode; a GPU runs the real thing")
def test_gpu_check_in_cpu_mode(tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = subprocess.run(
        ["bash", str(REPO / "bench" / "gpu_check.sh"), str(out)], cwd=tmp_path,
        env={**os.environ, "REPEATS": "3", "PYTHON": sys.executable},  # this venv, activated or not
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    summary = (out / "summary.txt").read_text()
    assert (
        "SKIP profile, plan-1gpu, train-1gpu, train-gpt, train-gpt-bf16, train-text-bf16: no CUDA "
        "device" in summary
    )
    assert "PASS matmul" in summary and "FAIL" not in summary
    assert "cpu-gloo:" in done.stdout and "TFLOP/s" in done.stdout  # the table, printed


def test_gpu_check_without_torch_says_which_interpreter(tmp_path: Path) -> None:
    """An interpreter without torch (a system python3 beside an unactivated venv) is named,
    with the fix, instead of a shell error further on."""
    bare = tmp_path / "bare-python"
    bare.write_text("#!/bin/sh\necho \"No module named 'torch'\" >&2\nexit 1\n")
    bare.chmod(0o755)
    done = subprocess.run(
        ["bash", str(REPO / "bench" / "gpu_check.sh"), str(tmp_path / "out")], cwd=tmp_path,
        env={**os.environ, "PYTHON": str(bare)}, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 1
    assert "cannot import torch" in done.stdout and "set PYTHON=" in done.stdout
    assert "integer expression expected" not in done.stdout + done.stderr
