"""benchmarks/gpu_check.py is `hydraulis check` on CUDA (tests/cli/test_cli_check.py runs the check itself):
without CUDA it is one line, exit 2; its arguments are the command's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_without_cuda_the_gpu_check_is_one_line_exit_2():
    done = run()
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and "sees no CUDA device" in done.stderr and "--device cpu" in done.stderr


def test_bad_arguments_are_one_line_exit_2():
    done = run("--device", "cpu", "--steps", "0")
    assert done.returncode == 2
    assert done.stderr.strip() == "error: --tokens and --steps must be positive, got 2048 and 0"
    done = run("--device", "cpu", "--model", "nope")
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "unknown model 'nope'" in done.stderr
