"""Starting a run: `run` starts the ranks here (spawned gloo processes) or joins torchrun's; each runs `run_rank`.

What a rank does is training/run.py's `Run`; this module only starts it, on the
settings `job.prepare` made, and restarts the ranks from the last checkpoint
after a local rank fails (`--max-restarts`).
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

from hydraulis.progress import keep_going, say
from hydraulis.runtime.parallelism.launch import RankFailed, leave_distributed, spawn
from hydraulis.training.job import torchrun_world
from hydraulis.training.run import Run, StopRequest
from hydraulis.training.settings import RunSettings


def run(settings: RunSettings) -> dict[str, Any] | None:
    """Run here (under torchrun) or on `settings.world` local processes; returns rank 0's summary.

    A failed local rank restarts the run from the last checkpoint, at most `invocation.max_restarts` times.
    """
    if torchrun_world() is not None or settings.world == 1:
        summary = run_rank(settings)
        leave_distributed()  # as a spawned rank does (launch._child)
        return summary
    start = time.perf_counter()
    restarts = settings.invocation.max_restarts
    for attempt in range(restarts + 1):
        try:
            results = spawn(run_rank, settings.world, settings)
            break
        except RankFailed as exc:
            if attempt == restarts:
                raise
            say(f"{exc}; restarting from the last checkpoint ({attempt + 1} of {restarts})")
            again = replace(settings.invocation, resume=True, resume_from=None)  # rank 0 picks again
            settings = replace(settings, invocation=again)
    summary = results[0]
    if summary is not None:
        summary["wall_s"] = time.perf_counter() - start
    return summary


def run_rank(settings: RunSettings) -> dict[str, Any] | None:
    """One rank's training; rank 0 returns the run summary.

    The stop request comes first: a SIGTERM or SIGINT while the rank starts (joining, building, resuming)
    stops the run cleanly at its first step boundary, as one during training does, instead of killing the
    rank half-way through writing its run directory.
    """
    stop = StopRequest()
    keep_going()  # the ranks share the launcher's terminal: one that goes away must not stop them
    try:
        return Run(settings, stop).train()
    finally:
        stop.restore()
