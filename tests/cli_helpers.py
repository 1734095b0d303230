"""Running the real `hydraulis` command from tests (a module of its own: tests/runtime has a conftest too)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def _env(changes: dict[str, str | None] | None = None) -> dict[str, str]:
    """The environment of a run: this checkout's source, COLUMNS=200, then `changes` (None removes a name)."""
    env = dict(os.environ, PYTHONPATH=str(SRC) + os.pathsep + os.environ.get("PYTHONPATH", ""), COLUMNS="200")
    for name, value in (changes or {}).items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env


def run_cli(
    *args: str, cwd: Path | None = None, timeout: float = 300, env: dict[str, str | None] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run the real `hydraulis` command (this checkout's source) and capture its output."""
    return subprocess.run(
        [sys.executable, "-m", "hydraulis.cli", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=_env(env),
        timeout=timeout,
    )


def start_cli(*args: str, cwd: Path | None = None) -> subprocess.Popen[str]:
    """Start the real command without waiting (to signal it); output unbuffered, so it can be followed."""
    return subprocess.Popen(
        [sys.executable, "-m", "hydraulis.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=cwd,
        env=dict(_env(), PYTHONUNBUFFERED="1"),
    )


def wait_for_handlers(proc: subprocess.Popen[str], timeout: float = 120) -> None:
    """Until the command catches SIGTERM (its handlers are installed: the kernel's SigCgt mask says so)."""
    import signal
    import time

    bit = 1 << (signal.SIGTERM - 1)
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, proc.communicate()
        status = Path(f"/proc/{proc.pid}/status").read_text()
        caught = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), 16)
        if caught & bit:
            return
        assert time.monotonic() < deadline, "the command never installed its signal handlers"
        time.sleep(0.02)


def _children(pid: int) -> list[int]:
    """Processes whose parent is `pid`, from /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.append(int(entry.name))
    return sorted(found)


def rank_pids(pid: int) -> list[int]:
    """The rank processes of the command `pid`: the children of the fork server it started
    (runtime/parallelism/launch.py)."""
    ranks = []
    for child in _children(pid):
        try:
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
        except OSError:
            continue
        if b"forkserver" in cmdline:
            ranks += _children(child)
    return sorted(ranks)


def one_line_error(res: subprocess.CompletedProcess[str], *needles: str) -> str:
    """A refusal as the project promises it: exit 2, no traceback, one `error: ` line naming each needle; the line."""
    assert res.returncode == 2, (res.returncode, res.stdout[-2000:], res.stderr[-2000:])
    assert "Traceback" not in res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]
