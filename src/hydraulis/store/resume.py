"""What `--resume` continues from, checked before any rank starts (no torch).

One rule picks the checkpoint (`checkpoints.latest_checkpoint`: the newest
that verifies whole). The LR schedule is part of the run: `[train] steps` is
its length, `--stop-at K` only ends this invocation early, and a resume whose
schedule differs from the checkpoint's is refused unless `--change-schedule`
asks for it (which prints both schedules).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydraulis.errors import HydraulisError
from hydraulis.progress import Log, say
from hydraulis.store.checkpoints import latest_checkpoint, read_manifest


@dataclass(frozen=True)
class ResumePoint:
    """The verified checkpoint a resume loads (None: there is none yet) and the step it continues at."""

    checkpoint: str | None
    step: int


def describe_lr_schedule(schedule: dict[str, Any]) -> str:
    """A schedule's inputs in one short phrase, e.g. `cosine lr 0.003 warmup 2 min_lr_ratio 0.1 over 20 steps`."""
    return (
        f"{schedule.get('schedule')} lr {schedule.get('lr')} warmup {schedule.get('warmup')} "
        f"min_lr_ratio {schedule.get('min_lr_ratio')} over {schedule.get('total_steps')} steps"
    )


def resume_point(
    checkpoints: Path, schedule: dict[str, Any], change_schedule: bool = False, log: Log = say
) -> ResumePoint:
    """The checkpoint to resume from, its schedule compared with this run's (`schedule`); raises on a mismatch."""
    if checkpoints.exists() and not checkpoints.is_dir():
        raise HydraulisError(f"{checkpoints}: not a directory, so it holds no checkpoint to resume; move it away")
    found = latest_checkpoint(checkpoints, sweep=False, log=log)
    if found is None:
        return ResumePoint(None, 0)
    info = read_manifest(found)
    old = {k: info.schedule.get(k) for k in schedule}
    if old != schedule:
        change = f"from {describe_lr_schedule(old)} to {describe_lr_schedule(schedule)}"
        if not change_schedule:
            raise HydraulisError(
                f"{found} was saved with another LR schedule: resuming would change it {change}; "
                "keep [train] steps and [optim] as they were (stop early with --stop-at K), "
                "or add --change-schedule"
            )
        log(f"--change-schedule: the LR schedule changes {change}")
    return ResumePoint(str(found), info.step)


def check_stop_at(stop_at: int | None, steps: int, start: int) -> None:
    """--stop-at K must lie after the resumed step and within the schedule."""
    if stop_at is None:
        return
    if not 1 <= stop_at <= steps:
        raise HydraulisError(f"--stop-at {stop_at} is outside the schedule's 1..{steps} steps ([train] steps)")
    if stop_at <= start:
        raise HydraulisError(f"--stop-at {stop_at} is not after step {start}, where the resume continues")
