"""A rank whose peers never join (one failed during start-up) fails within the timeout with one line."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("torch")

pytestmark = pytest.mark.dist

ALONE = """
import datetime, os, socket, sys
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
os.environ.update(RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
from hydraulis.errors import HydraulisError
from hydraulis.runtime.parallelism.launch import init_distributed
try:
    init_distributed("cpu", timeout=datetime.timedelta(seconds=3))
except HydraulisError as exc:
    print(exc)
    sys.exit(2)
"""


def test_a_rank_left_alone_at_start_up_is_one_line_without_a_cpp_trace():
    result = subprocess.run([sys.executable, "-c", ALONE], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rank 0 could not join the job's 2 ranks within 3 s"), lines
    assert "frame #" not in result.stdout + result.stderr and "Traceback" not in result.stderr
