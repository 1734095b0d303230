"""Progress of long work: a bar on a terminal, and plain lines in a log.

A cluster job's stderr is usually a file, where a live bar shows nothing
until it ends; there we print a line each tenth of the way (and at least once
a minute), so a long profile is never silent.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

LOG_EVERY_S = 60.0
Log = Callable[[str], None]  # what components report through, instead of printing


def say(message: str) -> None:
    """The run's log: one line on stdout, flushed at once (a cluster job's log may be a file)."""
    print(message, flush=True)


@contextmanager
def steps_progress(description: str, total: int) -> Iterator[Callable[[str, int], None]]:
    """Yields advance(label, steps): `label` names the work now running."""
    from rich.console import Console

    console = Console(stderr=True)
    if console.is_terminal:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        with Progress(*columns, console=console, transient=True) as bar:
            task = bar.add_task(description, total=total)
            yield lambda label, steps: bar.update(task, advance=steps, description=f"{description}: {label}")
        return
    start = last = time.perf_counter()
    done, shown = 0, 0

    def advance(label: str, steps: int) -> None:
        nonlocal done, shown, last
        done += steps
        now = time.perf_counter()
        tenth = 10 * done // max(1, total)
        if tenth > shown or now - last >= LOG_EVERY_S or done >= total:
            shown, last = tenth, now
            print(f"{description}: {label} {done}/{total} ({done / max(1, total):.0%}, {now - start:.0f} s)",
                  file=sys.stderr, flush=True)

    yield advance
