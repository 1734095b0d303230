"""`hydraulis check` through the real command, on CPU (its small sizes): the lines and the JSON report, the
attention checks against their fp32 reference, one training step under a memory budget, the cached
profiles that match this machine; and a broken attention path (a mutation applied in the command's own
process before it runs) makes it exit 1, naming what failed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from cli_helpers import _env  # noqa: E402

PROFILE = Path(__file__).resolve().parents[2] / "src" / "hydraulis" / "cost" / "profiles" / "tiny-cpu-measured.json"

# Run in the command's process before `hydraulis check`: varlen attention loses its causal mask (every token
# sees its whole document), and each CP chunk forgets the keys before it. Nothing in the package changes.
BROKEN = """
import sys
import torch.nn.functional as F
from hydraulis.runtime.modeling import attention, blockwise_attention

chunk_attention = blockwise_attention.chunk_attention

def no_causal_mask(q, k, v):
    heads = [t.transpose(0, 1).unsqueeze(0) for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*heads, enable_gqa=q.shape[1] != k.shape[1])
    return out.squeeze(0).transpose(0, 1)

def no_prefix(q, k, v, k_prefix, v_prefix, kernel=None):
    return chunk_attention(q, k, v, k_prefix[:0], v_prefix[:0], kernel)

attention.causal_sdpa = no_causal_mask
blockwise_attention.chunk_attention = no_prefix
from hydraulis.cli import main
sys.argv = ["hydraulis", *sys.argv[1:]]
main()
"""


def cached_profiles(cache: Path) -> None:
    """Two profiles in the shared cache: one measured on a machine of this one's cores, one of other cores."""
    data = json.loads(PROFILE.read_text())
    cores = len(os.sched_getaffinity(0))
    (cache / "profiles").mkdir(parents=True)
    for name, n in (("here", cores), ("elsewhere", cores + 1)):
        profile = {**data, "name": name, "conditions": {"world_size": 4, "threads_per_rank": 1, "cores": n}}
        (cache / "profiles" / f"tiny-{name}.json").write_text(json.dumps(profile))


def test_check_on_cpu_prints_its_lines_and_json_and_passes(tmp_path, cli):
    cached_profiles(tmp_path / "cache")
    out = tmp_path / "check.json"
    done = cli("check", "--device", "cpu", "--memory-per-rank", "64MiB", "--out", str(out),
               env={"HYDRAULIS_CACHE": str(tmp_path / "cache")})  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    print(done.stdout)
    assert lines[0].startswith(f"hydraulis check on cpu: torch {torch.__version__}") and len(lines) <= 12
    for said in ("collectives: nccl", "gloo works", "attention kernels", "varlen attention", "CP attention",
                 "training step tiny", "MFU", "memory: peak", "budget 64.0 MiB held", "ok: every check passed"):
        assert any(said in line for line in lines), said
    report = json.loads(out.read_text())
    assert report["ok"] and report["environment"]["torch"] == torch.__version__
    assert report["environment"]["gloo"]["available"] and report["step"]["collectives"]["gloo"]["works"]
    assert set(report["kernels"]) == {"fp32", "bf16"} and report["kernels"]["bf16"]["cp"] == "cpu-flash"
    # bf16 attention within bf16 precision of the fp32 reference, packed documents and CP chunks alike
    for check in ("varlen", "cp"):
        assert report[check]["ok"] and max(report[check]["rel_err"].values()) < 1e-2, report[check]
    assert len(report["cp"]["chunks"]) == 8 and sum(report["cp"]["chunks"]) == report["cp"]["document"]
    step = report["step"]
    assert step["ok"] and step["mfu"] > 0 and step["tokens_per_s"] > 0 and "estimate" in step["peak_source"]
    # a timed step holds the tokens --help promises on cpu (2048), within 10%: whole documents; the line says them
    assert all(0.9 * 2048 <= t <= 2048 for t in step["tokens_per_step"]), step["tokens_per_step"]
    assert "default: 65536; cpu 2048)" in " ".join(cli("check", "--help").stdout.split())
    said = next(line for line in lines if "tokens a step" in line)
    assert f"({np.mean(step['tokens_per_step']):,.0f} tokens a step)" in said, said
    # the Trainer's own figures: the CPU allocator's peak against the memory model's prediction, within the budget
    assert 0 < step["memory_peak_bytes"] <= step["budget_bytes"] == 64 << 20 and step["memory_predicted_bytes"] > 0
    assert [p["name"] for p in report["profiles"]] == ["here"]  # the other one was measured on other cores
    assert report["profiles"][0]["configs"] == ["tp1pp1", "tp1pp2", "tp1pp4", "tp2pp1", "tp2pp2", "tp4pp1"]


def test_a_broken_attention_path_fails_the_check(tmp_path):
    done = subprocess.run([sys.executable, "-c", BROKEN, "check", "--device", "cpu", "--json"], capture_output=True,
                          text=True, timeout=300, env=_env({"HYDRAULIS_CACHE": str(tmp_path)}))  # fmt: skip
    assert done.returncode == 1, done.stdout + done.stderr
    report = json.loads(done.stdout)
    assert not report["ok"] and not report["varlen"]["ok"] and not report["cp"]["ok"]
    assert report["varlen"]["rel_err"]["out"] > 0.1 and report["cp"]["rel_err"]["out"] > 0.1
    assert report["step"]["ok"]  # the step runs (on the broken attention too): only the checks against fp32 see it
