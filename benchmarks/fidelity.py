"""Fidelity: how well the cost model, measured here, predicts training iterations here.

Each run is the demo job (`examples/tiny-cpu.toml`: tiny on bbc-news, 4 CPU ranks, a pool of
4x(tp1,pp1) and 1x(tp2,pp1) + 2x(tp1,pp1)) for 30 steps with `profile = "auto"`: the pool's
configs are profiled on this machine first, then every step logs the simulator's prediction
beside the measured time. Printed per run: the median and worst absolute error of the iteration
time, the signed median (positive: predicted slower than measured) and the error per deployment.
The target is a median of at most 15%. On a shared machine the figure moves with other load,
which is why the script repeats the run.

Run: .venv/bin/python benchmarks/fidelity.py [--runs 3] [--steps 30] [--nproc 4] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "tiny-cpu.toml"


def run_once(workdir: Path, steps: int, nproc: int) -> dict:
    lines = EXAMPLE.read_text().splitlines()
    text = "\n".join(
        'profile = "auto"' if line.startswith("profile =") else f"steps = {steps}" if line.startswith("steps") else line
        for line in lines
    )
    path = workdir / "fidelity.toml"
    path.write_text(text + "\n")
    out = workdir / "run"
    cmd = [sys.executable, "-m", "hydraulis", "train", "--config", str(path), "--nproc", str(nproc), "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"training failed: {done.stderr.strip().splitlines()[-1] if done.stderr else done.returncode}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    summary, steps_rows = rows[-1]["summary"], rows[:-1]
    signed = [(r["predicted_s"] - r["iteration_s"]) / r["iteration_s"] for r in steps_rows]
    per_deployment: dict[str, list[float]] = {}
    for r, e in zip(steps_rows, signed, strict=True):
        per_deployment.setdefault(r["deployment"], []).append(abs(e))
    return {
        "median": summary["iteration_error_median"],
        "worst": summary["iteration_error_max"],
        "signed_median": statistics.median(signed),
        "per_deployment_median": {k: statistics.median(v) for k, v in per_deployment.items()},
        "tokens_per_s": summary["tokens_per_s"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    results = []
    for i in range(args.runs):
        with tempfile.TemporaryDirectory() as tmp:
            r = run_once(Path(tmp), args.steps, args.nproc)
        results.append(r)
        parts = ", ".join(f"{k} {v:.1%}" for k, v in r["per_deployment_median"].items())
        print(
            f"run {i + 1}: median {r['median']:.1%}, worst {r['worst']:.1%}, signed median "
            f"{r['signed_median']:+.1%} ({parts})",
            flush=True,
        )
    medians = [r["median"] for r in results]
    print(f"median of the runs' medians: {statistics.median(medians):.1%}; "
          f"{sum(m <= 0.15 for m in medians)} of {len(medians)} runs within 15%")
    if args.json:
        args.json.write_text(json.dumps({"runs": results}, indent=1))


if __name__ == "__main__":
    main()
