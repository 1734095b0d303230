"""SIGINT and SIGTERM as an exception, so that every `finally` and cleanup runs on the way out.

The CLI installs the handlers; library code only marks the few steps that
must not be cut in half (publishing a set of output files) with `held()`,
and names with `keep()` a finished output that an interruption after it
leaves on disk on purpose, so the CLI's last line says what is there.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager


class Interrupted(BaseException):
    """The process got SIGINT or SIGTERM. A BaseException, so `except Exception` does not swallow it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


_held = 0
_pending: list[int] = []
_kept: list[str] = []


def _handler(signum: int, frame: object) -> None:
    if _held:
        _pending.append(signum)
        return
    raise Interrupted(signum)


def install() -> None:
    """Raise Interrupted on SIGINT and SIGTERM (main thread only, where Python runs handlers)."""
    if threading.current_thread() is threading.main_thread():
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, _handler)


@contextmanager
def held() -> Iterator[None]:
    """Defer SIGINT/SIGTERM until the block ends (then raise), so it runs whole or not at all."""
    global _held
    _held += 1
    try:
        yield
    finally:
        _held -= 1
    if not _held and _pending:
        signum = _pending[0]
        _pending.clear()
        raise Interrupted(signum)


def keep(what: str) -> None:
    """Name a finished output (a path and why) that an interruption from now on leaves behind on purpose."""
    _kept.append(what)


def left_behind() -> str:
    """What an interruption leaves: 'nothing was written', or each kept output and why."""
    return "kept " + "; ".join(_kept) if _kept else "nothing was written"
