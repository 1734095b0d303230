"""Two local torchrun agents (2 nodes x 2 processes, c10d rendezvous on 127.0.0.1) through the real command.

Separate run directories (a node-local `--out`) are refused before training
with one line, and no checkpoint is published; a shared one trains and resumes.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

from cli_helpers import SRC  # noqa: E402
from train_helpers import make_corpus, step_rows, write_config  # noqa: E402

pytestmark = pytest.mark.dist

FOUR = {
    "parallel": 'pool = "4x(tp1,pp1); 2x(tp2,pp1)"\nprofile = "tiny@cpu"',
    "train": "steps = 2\nlog_every = 1\ntimeout_s = 30",
}
# timeout_s: a collective that never completes fails the run in seconds (the first step's in 90), with the
# ranks' tracebacks, instead of spending the suite's budget on the agents' timeout below.


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_nodes(config: Path, outs: tuple[Path, Path], *args: str, timeout: float = 180) -> list[tuple[int, str]]:
    """Start both agents at once (each its own working directory and --out); (exit code, output) of each."""
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(SRC) + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    procs = []
    for out in outs:
        out.parent.mkdir(parents=True, exist_ok=True)
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--max-restarts", "0",
            "-m", "hydraulis.cli", "train", "--config", str(config), "--out", str(out), *args,
        ]  # fmt: skip
        procs.append(subprocess.Popen(cmd, cwd=out.parent, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))  # fmt: skip
    results = []
    for p in procs:
        try:
            output, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            tails = [q.communicate()[0][-3000:] for q in procs]
            pytest.fail(f"the agents did not finish in {timeout:.0f} s; their last output:\n" + "\n---\n".join(tails))
        results.append((p.returncode, output))
    return results


def test_separate_run_directories_are_refused_before_training(tmp_path):
    config = write_config(tmp_path / "run.toml", make_corpus(tmp_path / "docs"), **FOUR)
    outs = (tmp_path / "node0" / "run", tmp_path / "node1" / "run")
    results = two_nodes(config, outs)
    assert all(code != 0 for code, _ in results), results
    text = "\n".join(output for _, output in results)
    line = f"error: the run directory {outs[0]} is not shared by all nodes (rank 2 cannot be seen from rank 0); "
    assert line + "use a shared file system path for [train] out" in text, text[-3000:]
    # Nothing went wrong before the one line; after it, torchrun's agent of the other node may log its
    # store connection closing as it shuts down (seen once under load), which is torchrun's, not ours.
    before = text.split("error: the run directory")[0]
    assert "TCPStore" not in before and "Traceback" not in before, text[-3000:]
    for out in outs:  # nothing trained, nothing published
        assert not (out / "checkpoints").exists() and not (out / "metrics.jsonl").exists()


def test_a_shared_run_directory_trains_and_resumes(tmp_path):
    config = write_config(tmp_path / "run.toml", make_corpus(tmp_path / "docs"), **FOUR)
    shared = tmp_path / "shared" / "run"
    first = two_nodes(config, (shared, shared), "--stop-at", "1")
    assert all(code == 0 for code, _ in first), first
    manifest = json.loads((shared / "checkpoints" / "step-000001" / "manifest.json").read_text())
    shards = sorted(n for n in manifest["files"] if n.endswith(".distcp"))
    assert shards == [f"optimizer/__{r}_0.distcp" for r in range(4)]
    more = two_nodes(config, (shared, shared), "--resume")
    assert all(code == 0 for code, _ in more), more
    assert "resuming at step 1" in "\n".join(output for _, output in more)
    assert [r["step"] for r in step_rows(shared)] == [0, 1]
    assert not list(shared.glob(".ranks-*"))  # the start-up tokens are gone
