"""The prepared check of the CUDA paths the CPU tests cannot reach, on one GPU: `hydraulis check --device cuda`.

The check is the command (src/hydraulis/cli/check.py, its work in runtime/check.py and
machine.py): torch, CUDA, NCCL and gloo, the devices, the attention kernel each dtype takes, varlen and CP
attention in bf16 against an fp32 reference, one training step of a model preset with its time, MFU and
peak memory against the memory model. This script runs it on CUDA unless told otherwise; its arguments are
the command's (`--json out.json` of old is `--out out.json`). Exit status: the command's (1 when a
correctness check fails, 2 on bad input or without CUDA).

    .venv/bin/python benchmarks/gpu_check.py [--model small] [--tokens 65536] [--steps 5] [--out out.json]
    .venv/bin/python benchmarks/gpu_check.py --device cpu
"""

from __future__ import annotations

import sys


def main(argv: list[str]) -> None:
    from hydraulis.cli import main as hydraulis

    device = [] if any(a == "--device" or a.startswith("--device=") for a in argv) else ["--device", "cuda"]
    sys.argv = ["hydraulis", "check", *device, *argv]
    hydraulis()


if __name__ == "__main__":
    main(sys.argv[1:])
