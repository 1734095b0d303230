"""Progress of long work and the console it is shown on: a bar on a terminal, plain lines in a log.

A cluster job's stderr is usually a file, where a live bar shows nothing
until it ends; there we print a line each tenth of the way (and at least once
a minute), so a long profile is never silent. Output that is not a terminal
(a pipe, a log file) is never wrapped: a line stays whole for grep and logs.

A training run must outlive its terminal: `keep_going` makes a closed or
broken terminal or pipe (`| tee` killed by the same Ctrl-C, `| head`, a closed
window) silent instead of fatal, and `transcribe` copies the run's lines
(`say`, `note`) into a file of its run directory, where they still arrive.
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TextIO

LOG_EVERY_S = 60.0
UNWRAPPED = 1 << 16  # the width of output that is not a terminal: wide enough that nothing wraps
LOG_RULE_WIDTH = 100  # a section rule in a log: a rule fills its width, so an unwrapped one would be 64K wide
Log = Callable[[str], None]  # what components report through, instead of printing


def say(message: str, stream: TextIO | None = None) -> None:
    """The run's log: one line on stdout (or `stream`), flushed at once (a cluster job's log may be a file),
    and in the run's transcript when there is one."""
    note(message)
    print(message, file=stream or sys.stdout, flush=True)


_transcript: TextIO | None = None  # the run directory's log file (transcribe), or None
_before: list[str] = []  # the lines said before there was one (a run's preparation), up to MAX_BEFORE
MAX_BEFORE = 1000


def transcribe(path: Path) -> None:
    """From now on `say` and `note` also append their lines to `path` (the run directory's log), after the
    ones said before (its preparation: a run directory is written only once its input is known good)."""
    global _transcript
    if _transcript is not None and not _transcript.closed:
        if _transcript.name == str(path):
            return
        _transcript.close()
    path.parent.mkdir(parents=True, exist_ok=True)
    _transcript = open(path, "a", encoding="utf-8")  # noqa: SIM115 - open for the process's life
    _transcript.write("".join(line + "\n" for line in _before))
    _transcript.flush()
    _before.clear()


def note(message: str) -> None:
    """One line into the transcript only: what the caller shows on the terminal by other means (rich)."""
    if _transcript is not None and not _transcript.closed:
        _transcript.write(message + "\n")
        _transcript.flush()
    elif len(_before) < MAX_BEFORE:
        _before.append(message)


class _Tolerant(io.TextIOBase):
    """A standard stream whose terminal or pipe may go away: the first write that fails (EPIPE, EIO) turns
    the stream's file descriptor into /dev/null, so this and every later write (print, rich, C++ warnings)
    succeeds without showing anything, and the work goes on."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.gone = False

    def write(self, text: str) -> int:
        if not self.gone:
            try:
                self.stream.write(text)
            except (OSError, ValueError):
                self._lose()
        return len(text)

    def flush(self) -> None:
        if not self.gone:
            try:
                self.stream.flush()
            except (OSError, ValueError):
                self._lose()

    def _lose(self) -> None:
        self.gone = True
        with contextlib.suppress(OSError, ValueError):
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, self.stream.fileno())
            os.close(null)

    def isatty(self) -> bool:
        return not self.gone and self.stream.isatty()

    def fileno(self) -> int:
        return self.stream.fileno()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return self.stream.encoding

    @property
    def errors(self) -> str | None:  # type: ignore[override]
        return self.stream.errors


def keep_going() -> None:
    """A closed or broken terminal or pipe no longer stops this process (idempotent): stdout and stderr
    swallow its write errors, and SIGHUP (the terminal closed) is ignored. Training runs call it in the
    launcher and in every rank: they share the terminal."""
    if not isinstance(sys.stdout, _Tolerant):
        sys.stdout = _Tolerant(sys.stdout)
    if not isinstance(sys.stderr, _Tolerant):
        sys.stderr = _Tolerant(sys.stderr)
    if threading.current_thread() is threading.main_thread():  # where Python sets handlers
        signal.signal(signal.SIGHUP, signal.SIG_IGN)


def aside(message: str) -> None:
    """A library's default log (checkpoint discovery outside a run, `hydraulis export`): on stderr, so that
    stdout stays the caller's own output."""
    say(message, sys.stderr)


def console(stderr: bool = False) -> Any:
    """A rich Console: on a terminal its width; elsewhere (a pipe, a file) one that never wraps a line."""
    from rich.console import Console

    out = Console(stderr=stderr)
    if not out.is_terminal:
        out.width = UNWRAPPED
    return out


def table(title: str, columns: list[str], rows: list[list[Any]], left: int = 1) -> Any:
    """A table under its title, the first `left` columns left-justified, the rest right-justified.

    The title is a line of its own: a rich table's title is wrapped to the table's width and padded to it,
    which broke long titles and left trailing spaces in piped output."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    t = Table()
    for i, column in enumerate(columns):
        t.add_column(column, justify="left" if i < left else "right")
    for row in rows:
        t.add_row(*[str(x) for x in row])
    return Group(Text(title, style="italic"), t)


def rule(out: Any, title: str) -> None:
    """A section heading across the terminal, or LOG_RULE_WIDTH wide in a log."""
    from rich.rule import Rule

    out.print(Rule(title), width=min(out.width, LOG_RULE_WIDTH))


LOG_QUIET_S = 10.0  # a log hears of work shorter than this only from its result


@contextmanager
def byte_progress(total: int, description: str, enabled: bool = True) -> Iterator[Callable[[int], None] | None]:
    """Progress over input bytes on stderr, with the throughput and the time left: a rich bar on a terminal,
    in a log a line each tenth of the way (and at least once a minute) once the work has run LOG_QUIET_S;
    None (nothing shown) when disabled or rich is missing."""
    if not enabled:
        yield None
        return
    try:
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )
    except ImportError:
        yield None
        return
    err = console(stderr=True)
    if not err.is_terminal:
        yield _byte_lines(total, description)
        return
    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
               TimeRemainingColumn())  # fmt: skip
    with Progress(*columns, console=err, transient=True) as bar:
        task = bar.add_task(description, total=total)
        yield lambda n: bar.advance(task, n)


class _LogPace:
    """When a log hears of progress: each tenth of the way and at least once a minute, after `quiet_s`."""

    def __init__(self, total: int, quiet_s: float = 0.0) -> None:
        self.total = total
        self.quiet_s = quiet_s
        self.start = self.last = time.perf_counter()
        self.done = self.shown = 0

    def advance(self, n: int, last_too: bool = False) -> float | None:
        """Count `n` more; the seconds since the start when a line is due now (also at the end, `last_too`)."""
        self.done += n
        now = time.perf_counter()
        tenth = 10 * self.done // max(1, self.total)
        if now - self.start < self.quiet_s:
            return None
        if tenth > self.shown or now - self.last >= LOG_EVERY_S or (last_too and self.done >= self.total):
            self.shown = tenth
            self.last = now
            return now - self.start
        return None


def _byte_lines(total: int, description: str) -> Callable[[int], None]:
    """byte_progress's advance in a log: MB done, MB/s, the time left."""
    pace = _LogPace(total, LOG_QUIET_S)

    def advance(n: int) -> None:
        elapsed = pace.advance(n)
        if elapsed is not None:
            done = pace.done
            rate = done / elapsed
            left = (total - done) / rate if rate > 0 else float("inf")
            print(f"{description}: {done / 1e6:,.0f}/{total / 1e6:,.0f} MB ({done / max(1, total):.0%}), "
                  f"{rate / 1e6:.1f} MB/s, {left:.0f} s left", file=sys.stderr, flush=True)

    return advance


@contextmanager
def steps_progress(description: str, total: int) -> Iterator[Callable[[str, int], None]]:
    """Yields advance(label, steps): `label` names the work now running."""
    err = console(stderr=True)
    if err.is_terminal:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        with Progress(*columns, console=err, transient=True) as bar:
            task = bar.add_task(description, total=total)
            yield lambda label, steps: bar.update(task, advance=steps, description=f"{description}: {label}")
        return
    pace = _LogPace(total)

    def advance(label: str, steps: int) -> None:
        elapsed = pace.advance(steps, last_too=True)
        if elapsed is not None:
            done = pace.done
            print(f"{description}: {label} {done}/{total} ({done / max(1, total):.0%}, {elapsed:.0f} s)",
                  file=sys.stderr, flush=True)

    yield advance


@contextmanager
def stage_progress(description: str) -> Iterator[Callable[[str, int, int], None]]:
    """Yields report(stage, done, total) for work whose stages each have their own total (a proposal): a rich
    bar on a terminal (it leaves no line behind), in a log a line at each tenth of a stage and at its end."""
    err = console(stderr=True)
    if err.is_terminal:
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        columns = (TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                   TimeElapsedColumn())  # fmt: skip
        with Progress(*columns, console=err, transient=True) as bar:
            task = bar.add_task(description, total=None)
            yield lambda stage, done, total: bar.update(task, description=stage, completed=done, total=total)
        return
    paces: dict[str, _LogPace] = {}

    def report(stage: str, done: int, total: int) -> None:
        pace = paces.setdefault(stage, _LogPace(total))
        elapsed = pace.advance(done - pace.done, last_too=True)
        if elapsed is not None:
            print(f"{description}: {stage} {done}/{total} ({elapsed:.0f} s)", file=sys.stderr, flush=True)

    yield report
