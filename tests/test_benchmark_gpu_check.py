"""benchmarks/gpu_check.py: its CPU smoke mode runs the whole check end to end, and without CUDA the
GPU mode is one line, exit 2. (On a GPU the same script is the check of the CUDA paths.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300)


def test_smoke_mode_checks_attention_and_a_training_step(tmp_path):
    out = tmp_path / "check.json"
    done = run("--device", "cpu", "--json", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())
    # bf16 attention within bf16 precision of the fp32 reference, packed documents and CP chunks alike
    for check in ("varlen", "cp"):
        assert report[check]["ok"] and max(report[check]["rel_err"].values()) < 1e-2, report[check]
    assert report["cp"]["kernel"] == "cpu-flash" and len(report["cp"]["chunks"]) == 8
    assert sum(report["cp"]["chunks"]) == report["cp"]["document"]
    step = report["step"]
    assert step["ok"] and step["mfu"] > 0 and step["tokens_per_s"] > 0
    # The Trainer's own figures: the CPU allocator's peak against the memory model's prediction.
    assert step["memory_peak_bytes"] > 0 and step["memory_predicted_bytes"] > 0
    lines = done.stdout.splitlines()
    assert lines[0].startswith("gpu_check on cpu") and any("MFU" in line for line in lines)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_without_cuda_the_gpu_mode_is_one_line_exit_2():
    done = run()
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and "sees no CUDA device" in done.stderr and "--device cpu" in done.stderr


def test_bad_arguments_are_one_line_exit_2():
    done = run("--device", "cpu", "--steps", "0")
    assert done.returncode == 2
    assert done.stderr.strip() == "gpu_check: --tokens and --steps must be positive, got 2048 and 0"
    done = run("--device", "cpu", "--model", "nope")
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "unknown model 'nope'" in done.stderr
