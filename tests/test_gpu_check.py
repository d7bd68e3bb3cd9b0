"""``make gpu-check`` (benchmarks/gpu_check.py) where there is no GPU: one line that says so,
exit 2, nothing started. On a GPU machine the command itself is the test."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_check.py"


def test_without_a_gpu_the_check_says_so_in_one_line_and_exits_2():
    torch = pytest.importorskip("torch", reason="the torch extra: make .venv/.installed-torch-stamp")
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is here: run make gpu-check")
    done = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    (line,) = done.stdout.splitlines()
    said = json.loads(line)
    assert said["ok"] is False and said["error"].startswith("no CUDA GPU on this machine")
    assert "make device-bundle" in said["error"]  # what to do instead: the bundle for a borrowed GPU
