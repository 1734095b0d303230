"""`processes.leave`: the command's process leaves without finalizing the interpreter, yet keeps its exit code,
its threads' and atexit functions' work and its output; a process that never recorded an ending exits as usual."""

from __future__ import annotations

import subprocess
import sys

import pytest

SCRIPT = """
import atexit, sys, threading, time
from hydraulis.processes import leave
leave.after_atexit()
atexit.register(print, "atexit ran")
threading.Thread(target=lambda: (time.sleep(0.2), print("thread finished"))).start()
print("work", flush=False)
class Noisy:  # finalizing the interpreter would print from its __del__; leaving does not
    def __del__(self):
        print("finalized")
keep = Noisy()
{end}
"""


@pytest.mark.parametrize(("end", "code"), [("leave.ending(3); sys.exit(3)", 3), ("leave.ending(None); sys.exit()", 0),
                                           ("leave.ending('bad'); sys.exit('bad')", 1)])
def test_a_recorded_ending_keeps_the_code_the_threads_and_the_atexit_functions_and_skips_finalizing(end, code):
    done = subprocess.run([sys.executable, "-c", SCRIPT.format(end=end)], capture_output=True, text=True, timeout=60)
    assert done.returncode == code, done.stderr
    assert done.stdout.split("\n")[:3] == ["work", "thread finished", "atexit ran"], done.stdout
    assert "finalized" not in done.stdout


def test_without_an_ending_the_process_finalizes_as_usual():
    done = subprocess.run([sys.executable, "-c", SCRIPT.format(end="")], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["work", "thread", "finished", "atexit", "ran", "finalized"], done.stdout
