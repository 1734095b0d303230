"""Ending a process, its output flushed, without finalizing the interpreter.

Why: a command that imported torch took 0.7 s on 2 cores to tear its modules down after its work and every
atexit function were done (measured 2026-12-07 after `hydraulis train`), and whoever reads its output (a
pipe, `| tee`, a test) waits for that. Nothing in the teardown is the job's: files are closed where they are
written, and what needs an ending at exit (multiprocessing's children, logging, temporary directories)
registers an atexit function, which runs first. A process that joined a training job leaves the same way for
another reason (`launch.leave_process`). Torch-free.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys

_code: int | None = None  # the exit code the command ended with; None: finalize as usual


def leave(code: int) -> None:
    """End the process now with `code`, stdout and stderr flushed first."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def after_atexit() -> None:
    """Leave with the code `ending` records once threads are joined and every other atexit function has run:
    registered before them (they run last-registered first), so call it before importing anything that
    registers one."""
    atexit.register(_leave_if_ending)


def ending(code: object) -> None:
    """Record how the command ends (a SystemExit's code): 0 for None, 1 for a message, as Python exits."""
    global _code
    _code = 0 if code is None else code if isinstance(code, int) else 1


def _leave_if_ending() -> None:
    if _code is not None:
        leave(_code)
