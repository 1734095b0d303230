"""`hydraulis train` outlives its terminal: Ctrl-C typed into a pseudo-terminal while the output goes through a
pipe whose reader dies (`| tee`, killed by the same Ctrl-C) or has left (`| head`) still saves and exits 0."""

from __future__ import annotations

import fcntl
import os
import shlex
import signal
import subprocess
import sys
import termios
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")

from cli_helpers import SRC  # noqa: E402
from train_helpers import step_rows, write_config  # noqa: E402

pytestmark = pytest.mark.dist

TWO = {"parallel": 'pool = "2x(tp1,pp1); 1x(tp2,pp1)"\nprofile = "tiny@cpu"', "train": "steps = 400\nlog_every = 1"}


def _controlling_tty() -> None:
    """In the child: Ctrl-C as a user's fresh shell has it (SIGINT at its default and unblocked, whatever the test
    process inherited or holds: an ignored or blocked SIGINT would let tee outlive the Ctrl-C), and stdin, the pty's
    slave, the new session's terminal."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


class Terminal:
    """A shell script in a session of its own on a fresh pseudo-terminal, whose foreground process group (the
    shell and everything it runs) gets what is typed; what the terminal shows is read on (`shown`)."""

    def __init__(self, script: str) -> None:
        master, slave = os.openpty()
        env = dict(os.environ, PYTHONPATH=str(SRC) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.proc = subprocess.Popen(["bash", "-c", script], stdin=slave, stdout=slave, stderr=slave, env=env,
                                     start_new_session=True, preexec_fn=_controlling_tty)  # fmt: skip
        os.close(slave)
        self.master, self.shown = master, bytearray()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        while True:
            try:
                chunk = os.read(self.master, 4096)
            except OSError:  # the session ended
                return
            if not chunk:
                return
            self.shown.extend(chunk)

    def type(self, keys: bytes) -> None:
        os.write(self.master, keys)

    def wait(self, timeout: float = 120) -> None:
        self.proc.wait(timeout=timeout)
        self.reader.join(timeout=5)
        os.close(self.master)


def wait_for(condition, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.05)


def train_command(config: Path, out: Path) -> str:
    args = ["-m", "hydraulis.cli", "train", "--config", str(config), "--nproc", "2", "--out", str(out)]
    return shlex.join([sys.executable, *args])


def check_saved_at_the_step_reached(out: Path, status: Path, terminal: Terminal) -> None:
    shown = terminal.shown.decode(errors="replace")
    assert status.read_text().strip() == "0", shown  # hydraulis's own exit code, not the pipe's last command's
    done = step_rows(out)
    assert [r["step"] for r in done] == list(range(len(done)))
    assert [p.name for p in (out / "checkpoints").glob("step-*")] == [f"step-{len(done):06d}"]
    assert (out / "summary.json").is_file() and (out / "report.png").is_file()
    log = (out / "train.log").read_text()  # what the terminal no longer showed arrived here
    assert f"stopped by SIGINT at step {len(done)}" in log and "\ndone: " in log


def test_ctrl_c_with_tee_killed_by_it_saves_and_exits_0(tmp_path, corpus):
    config = write_config(tmp_path / "run.toml", corpus, **TWO)
    out, status, teed = tmp_path / "out", tmp_path / "status", tmp_path / "teed"
    # `trap : INT`: the shell outlives the Ctrl-C (its children get SIGINT's default back) to write the status
    terminal = Terminal(f"trap : INT; {train_command(config, out)} 2>&1 | tee {teed}; "
                        f'echo "${{PIPESTATUS[0]}}" > {status}')  # fmt: skip
    wait_for(lambda: len(step_rows(out, running=True)) >= 2)
    terminal.type(b"\x03")  # Ctrl-C: SIGINT to hydraulis, its ranks and tee
    terminal.wait()
    check_saved_at_the_step_reached(out, status, terminal)
    assert "step    0" in teed.read_text()  # tee showed the run until the Ctrl-C
    assert "saved " not in teed.read_text()  # and nothing after it: it died of the Ctrl-C


def test_ctrl_c_after_the_pipe_was_closed_mid_run_saves_and_exits_0(tmp_path, corpus):
    config = write_config(tmp_path / "run.toml", corpus, **TWO)
    out, status, left = tmp_path / "out", tmp_path / "status", tmp_path / "head-left"
    # the reader takes 3 lines and leaves: every later write of the run meets a closed pipe
    terminal = Terminal(f"trap : INT; {train_command(config, out)} 2>&1 | {{ head -n 3; touch {left}; }}; "
                        f'echo "${{PIPESTATUS[0]}}" > {status}')  # fmt: skip
    wait_for(left.exists)
    reached = len(step_rows(out, running=True))
    wait_for(lambda: len(step_rows(out, running=True)) >= reached + 2)  # steps that wrote into the closed pipe
    terminal.type(b"\x03")
    terminal.wait()
    check_saved_at_the_step_reached(out, status, terminal)
