"""What `--resume` continues from, checked before any rank starts (no torch).

One rule picks the checkpoint (`manifest.latest_checkpoint`: the newest
that verifies whole). The LR schedule is part of the run: `[train] steps` is
its length, `--stop-at K` only ends this invocation early, and a resume whose
schedule differs from the checkpoint's is refused unless `--change-schedule`
asks for it (which prints both schedules). So is a change of the config that
decides the batches and plans (`DECIDING`), unless `--change-config` asks for it.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hydraulis.checkpoints.manifest import latest_checkpoint, read_manifest
from hydraulis.errors import HydraulisError
from hydraulis.files import read_text
from hydraulis.progress import Log, say


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


DECIDING = ("data", "model", "parallel", "optim")  # the config sections that decide a run's batches and plans
SCHEDULE_KEYS = ("lr", "warmup", "schedule", "min_lr_ratio")  # [optim] keys the LR schedule's check covers


def config_changes(
    old: dict[str, Any], new: dict[str, Any], defaults: dict[str, dict[str, Any]] | None = None
) -> tuple[list[str], list[str]]:
    """What a resume would change of a run's recorded config (both as read from TOML: a key unset is absent):
    `section.key (old -> new)` for the keys that decide the batches and plans, then for the others. A key absent
    from one side reads as its default (`defaults`), so a key added to the config after a run was saved, at its
    default, is no change."""
    deciding, others = [], []
    for section in sorted(old.keys() | new.keys()):
        was, now, default = old.get(section, {}), new.get(section, {}), (defaults or {}).get(section, {})
        for key in sorted(was.keys() | now.keys()):
            before, after = was.get(key, default.get(key)), now.get(key, default.get(key))
            if before != after and not (section == "optim" and key in SCHEDULE_KEYS):
                change = f"{section}.{key} ({_shown(before)} -> {_shown(after)})"
                (deciding if section in DECIDING else others).append(change)
    return deciding, others


def check_config_change(
    run_dir: Path,
    config_toml: str,
    change_config: bool,
    log: Log = say,
    defaults: dict[str, dict[str, Any]] | None = None,
) -> None:
    """Refuse a resume whose config (`config_toml`, resolved) changes what decides the batches and plans of the
    run it continues (its config.toml), unless `change_config`; say what else config.toml will record anew.
    `defaults`: every key's default, for keys a run's config.toml predates."""
    recorded = run_dir / "config.toml"
    try:
        old = tomllib.loads(read_text(recorded))
    except tomllib.TOMLDecodeError as exc:
        raise HydraulisError(f"{recorded}: not valid TOML ({exc}), so the run it records cannot be resumed") from None
    deciding, others = config_changes(old, tomllib.loads(config_toml), defaults)
    if deciding and not change_config:
        raise HydraulisError(
            f"{run_dir}: resuming would change {', '.join(deciding)}: a resume trains the batches and plans of the "
            "run it continues (its config.toml); put them back in --config, or add --change-config to mean it"
        )
    if deciding:
        log(f"--change-config: from the resumed step the run trains with {', '.join(deciding)}")
    if others:
        log(f"resuming with {', '.join(others)}; config.toml records the change")


def _shown(value: Any) -> str:
    return "unset" if value is None else repr(value)


def check_stop_at(stop_at: int | None, steps: int, start: int) -> None:
    """--stop-at K must lie after the resumed step and within the schedule."""
    if stop_at is None:
        return
    if not 1 <= stop_at <= steps:
        raise HydraulisError(f"--stop-at {stop_at} is outside the schedule's 1..{steps} steps ([train] steps)")
    if stop_at <= start:
        raise HydraulisError(f"--stop-at {stop_at} is not after step {start}, where the resume continues")
