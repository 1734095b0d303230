"""The conditions a profile was measured under, and a run's: world size, threads, cores, other processes' load;
and how ranks that share cores slow each other (`SharedCores`).

Why: a CPU profile predicts a run only under the conditions it was measured
in. Ranks beside it, threads per rank and the cores all change a rank's
speed, and so does load from other processes: a profile measured while
something else computed predicted every step of a quiet run about 30% too
slow. The profile records its conditions (`Conditions`), the profiler
measures again what was timed under load (`CpuMeter`), and a run whose own
conditions differ says so in one line (`differences`).

Load is measured, not guessed from the load average (a minute's mean): the
machine's busy CPU time (/proc/stat) minus the job's own processes' CPU time
(/proc/PID/stat), per second of wall time, is the cores other processes took.
Linux only; elsewhere the meter reads nothing and no load is reported. No torch.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hydraulis.parallel import ParallelConfig

# Other processes taking more than this share of the cores disturb a measurement (2 cores: 0.2 of a core).
DISTURBED_SHARE = 0.1


def cpu_cores() -> int:
    """Cores this process may run on (the affinity mask, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _machine_busy_ticks() -> int | None:
    """Clock ticks every CPU of the machine spent busy (steal counts: another VM took the core)."""
    try:
        with open("/proc/stat", encoding="ascii") as fh:
            fields = fh.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    ticks = [int(v) for v in fields[1:9]]
    return sum(ticks) - ticks[3] - ticks[4]  # all but idle and iowait


def _process_ticks(pid: int) -> int:
    """User plus system clock ticks of one process, all its threads (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as fh:
            text = fh.read()
    except OSError:
        return 0
    fields = text[text.rfind(")") + 2 :].split()  # after the command name, which may hold spaces
    return int(fields[11]) + int(fields[12])


class CpuMeter:
    """Cores taken by processes other than `pids` between two readings (`foreign_cores`)."""

    def __init__(self, pids: Sequence[int]) -> None:
        self.pids = tuple(pids)
        self.tick = float(os.sysconf("SC_CLK_TCK")) if hasattr(os, "sysconf") else 100.0
        self._last = self._read()

    def _read(self) -> tuple[float, int, int] | None:
        busy = _machine_busy_ticks()
        if busy is None:
            return None
        return time.perf_counter(), busy, sum(_process_ticks(p) for p in self.pids)

    def foreign_cores(self) -> float | None:
        """Mean cores other processes used since the last call (None where it cannot be read)."""
        now, last = self._read(), self._last
        self._last = now
        if now is None or last is None or now[0] <= last[0]:
            return None
        foreign = (now[1] - last[1]) - (now[2] - last[2])
        return max(0.0, foreign / self.tick / (now[0] - last[0]))


def spare_core(world: int, threads_per_rank: int, cores: int) -> bool:
    """Whether CPU ranks leave a core for one more thread: rank 0's planner plans the next batch beside compute
    only then (runtime/plan_feed.py).

    Why: on cores the ranks fill, the planner beside compute took them from the ranks, which the profile had not
    timed: in the demo (4 ranks, 2 cores, planning 0.15 s of a 0.5 s step) every iteration ran 1.36-1.38x slower
    than with the same plans made while the ranks waited, for the same wall time in all (docs/results.md)."""
    return world * threads_per_rank < cores


def disturbed(foreign_cores: float | None, cores: int) -> bool:
    """Whether other processes took enough of the cores to disturb a timing."""
    return foreign_cores is not None and foreign_cores > DISTURBED_SHARE * cores


@dataclass(frozen=True)
class Conditions:
    """What a CPU timing depends on besides the model: ranks, threads per rank, cores, others' load (cores)."""

    world_size: int
    threads_per_rank: int
    cores: int
    foreign_cores: float | None = None  # other processes' mean load while measuring (None: not measured)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Any) -> Conditions | None:
        """A profile's recorded conditions; None for a profile that did not record them (or not all)."""
        try:
            load = data.get("foreign_cores")
            return cls(
                int(data["world_size"]),
                int(data["threads_per_rank"]),
                int(data["cores"]),
                None if load is None else float(load),
            )
        except (AttributeError, KeyError, TypeError, ValueError):
            return None


def differences(profile: Conditions, run: Conditions) -> list[str]:
    """How a run's conditions differ from its profile's, each a short phrase (empty: they match)."""
    out = []
    for key, what in (("world_size", "ranks"), ("threads_per_rank", "threads per rank"), ("cores", "cores")):
        mine, theirs = getattr(run, key), getattr(profile, key)
        if mine != theirs:
            out.append(f"{mine} {what} (the profile: {theirs})")
    before = disturbed(profile.foreign_cores, profile.cores)
    now = disturbed(run.foreign_cores, run.cores)
    if before != now and run.foreign_cores is not None and profile.foreign_cores is not None:
        out.append(
            f"other processes use {run.foreign_cores:.2f} of {run.cores} cores "
            f"(while profiling: {profile.foreign_cores:.2f})"
        )
    return out


def warning(profile: Conditions | None, run: Conditions) -> str | None:
    """The one line a run prints when its conditions differ from its profile's (None: they match)."""
    if profile is None:
        return None
    diff = differences(profile, run)
    if not diff:
        return None
    return "cost model: this run differs from its profile's conditions: " + "; ".join(diff) + \
        " (predictions carry the difference; profile under the run's conditions to remove it)"


@dataclass(frozen=True)
class SharedCores:
    """CPU ranks that share `cores` cores, and how many computed at once when each config was measured.

    Why: with more ranks than cores (gloo on a laptop) a replica's time depends on how many
    ranks compute beside it, and a plan that leaves replicas idle runs the busy ones faster.
    Processor sharing: k busy ranks of `threads_per_rank` threads each are slowed by
    max(1, k * threads / cores), so a time measured at one load is rescaled to another; the
    simulator runs every replica's stages together under it (planner/sim.py).
    """

    cores: int
    threads_per_rank: int
    busy_ranks: dict[ParallelConfig, int]  # ranks computing at once while the config was measured

    def load(self, busy: int) -> float:
        return max(1.0, busy * self.threads_per_rank / self.cores)

    def slowdown(self, config: ParallelConfig, busy: int) -> float:
        """How much slower than alone a stage of `config` computes while `busy` ranks compute."""
        return self.load(busy)
