"""Rank 0's watch over its predictions during a run: the run's conditions, and the online refit.

At the start one line says how this run's world size, threads per rank and
cores differ from its profile's (cost/conditions.py). Every step the CPU
meter reads other processes' load; once `LOAD_STEPS` steps show it disturbed
where the profile was quiet (or the reverse), one line says so. The
predicted and measured replica times of every step feed the online refit
(cost/refit.py): a refit is announced in one line, the planner plans with it
from the next batch on (under a lasting load it follows the load: this run
is under it), and the refit profile is written beside the run
(`profile.refit.json`, with the load of the steps it saw), never into the
shared cache: the next run starts from the measured profile, so one run's
noise does not become the next run's start (`[parallel] profile` naming
a `profile.refit.json` starts from it on purpose). A checkpoint keeps the
refit (`OnlineRefit.state`), and a resume on as many ranks plans with it
from its first step, as the run it continues would. Dividing
each step by the slowdown processor sharing gives its load was tried and
dropped: on 2 cores, in one run, a process taking a core slowed 4 ranks
about 1.9x over the first steps, where processor sharing gives 1.25x (ranks
that synchronise wait for a descheduled peer).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from hydraulis.cost.conditions import Conditions, CpuMeter, cpu_cores, warning
from hydraulis.cost.refit import REFIT_STEPS, OnlineRefit, Refit, refit_profile
from hydraulis.files import write_json_atomic
from hydraulis.training.auto_profile import REFIT_PROFILE

if TYPE_CHECKING:
    from hydraulis.checkpoints.manifest import CheckpointInfo
    from hydraulis.runtime.metering.step_meter import StepMetrics
    from hydraulis.runtime.trainer import Trainer
    from hydraulis.training.settings import RunSettings

LOAD_STEPS = 5  # steps of other processes' load before a run says its load differs from the profile's


class RunFidelity:
    """Built on rank 0 after the trainer; `after(metrics)` once per step."""

    def __init__(
        self, settings: RunSettings, trainer: Trainer, pids: Sequence[int], threads: int, log: Callable[[str], None],
        resumed: CheckpointInfo | None = None,
    ):
        self.settings = settings
        self.trainer = trainer
        self.log = log
        self.profile_data = settings.trainer.parallel.cost.profile_data  # the profile the run started from
        self.profile = Conditions.from_json((self.profile_data or {}).get("conditions"))
        self.run = Conditions(settings.world, threads, cpu_cores())
        self.meter = CpuMeter(pids)
        self.loads: list[float | None] = []  # other processes' cores, per step
        self.load_said = False
        self.seen: set[int] = set()  # deployments that ran once
        self.observed: list[float | None] = []  # the load of every step the refit saw
        self.refit = OnlineRefit(settings.trainer.parallel.cost)
        line = warning(self.profile, self.run)
        if line:
            log(line)
        if resumed is not None:
            self._resume(resumed)

    def _resume(self, resumed: CheckpointInfo) -> None:
        """Plan with the refit the checkpoint kept; on another world size (other conditions) start afresh."""
        state = resumed.refit
        if state is None:
            return
        if resumed.world_size != self.settings.world:
            if state.coefficients:
                self.log(f"the cost model's refit in {resumed.path} was made on {resumed.world_size} rank(s); "
                         f"this run has {self.settings.world}, so it plans with its profile again")
            return
        done = self.refit.restore(state)
        if done is not None:
            self.trainer.use_cost(done.cost)
            parts = ", ".join(f"{c.name} x{s:.2f}" for c, s in done.scales.items())
            self.log(f"planning with the cost model refit after step {done.step} ({parts}), kept in {resumed.path}")

    def after(self, metrics: StepMetrics) -> dict[str, Any]:
        """Read this step's load and replica times (maybe one line on load, maybe a refit); the step's load."""
        load = self.meter.foreign_cores()
        self.loads.append(load)
        self._load_line()
        indices = metrics.deployment_indices or (metrics.deployment_index,)  # a phased step: one per phase
        if not self.seen.issuperset(indices):  # a deployment's first step warms it up: no steady state
            self.seen.update(indices)
        else:
            self.observed.append(load)
            configs = [c for k in indices for c in self.settings.trainer.parallel.pool[k].configs]  # replica_s's order
            done = self.refit.observe(metrics.step, configs, metrics.replica_s, metrics.replica_predicted_s)
            if done is not None:
                self._use(done)
        return {"foreign_cores": load}

    def _use(self, done: Refit) -> None:
        """Plan the next batches with a refit model and predict them with it; keep it; say so in one line."""
        self.trainer.use_cost(done.cost)
        self.log(done.line() + self._keep(done.step))

    def _load_line(self) -> None:
        """After LOAD_STEPS measured steps (the first left out): one line if the load differs from the profile's."""
        loads = [x for x in self.loads[1:] if x is not None]
        if self.profile is None or self.load_said or len(loads) < LOAD_STEPS:
            return
        self.load_said = True
        now = replace(self.profile, foreign_cores=float(np.median(loads)))  # only the load differs
        line = warning(self.profile, now)
        if line:
            self.log(line)

    def _keep(self, step: int) -> str:
        """Write the refit profile beside the run, with the load of the steps it saw. Never into the shared
        cache: a run's refit follows its own conditions, and a later run starts from the measured profile."""
        data = self.profile_data
        if data is None:
            return " (an analytic model: no profile file to keep it in)"
        recent = [x for x in self.observed[-REFIT_STEPS:] if x is not None]
        load = float(np.median(recent)) if recent else None
        out = str(self.settings.out)
        refit = refit_profile(data, self.refit.scales, out, step, replace(self.run, foreign_cores=load))
        path = self.settings.out / REFIT_PROFILE
        write_json_atomic(path, refit)
        return f"; kept in {path}"
