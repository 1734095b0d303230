"""Online refit: a config whose predictions stay more than 15% off during training is refit from the run.

Why: a profile is taken once, under its own conditions (load from other
processes, another world size, a machine that changed); the trainer measures
every replica every step. When a config's replicas are off their
predicted times on the same side in all but one of `window` steps in a
row (one disturbed step on a shared machine does not restart the count:
on 2 cores a 17% bias waited 12 steps for 5 clean ones in a row), its
coefficients (a, b, c) are scaled by the median measured / predicted
ratio of those steps, and the planner plans with the refit model from then on.

Only evidence that outlasts noise counts, as a busy machine's steps are
noisy: on 2 cores beside other work one run's refit swung tp1pp1 by x0.74,
x1.33 and x0.83 within 30 steps. So the window's median must also lie at
least `SPREAD_MULTIPLE` robust standard errors from 1, the errors of the
scatter of the config's last `SCATTER_STEPS` steps (`off_level`): a level
that moves as much as the steps scatter (a burst of load that comes and
goes) is noise, not a wrong model. Clearing the watch whenever other
processes' load changed was tried and dropped: on a shared machine the load
flickers about the threshold, so the refit then depended on the timing of
other work, and a resume no longer planned as the run it continues. Simulated over 100 steps of a right model with
i.i.d. log-normal noise (40 seeds), the rule without this test refit 2.4
times at 20% noise and 5.7 times at 30%; with it 0.3 and 0.7, while a 25% or
100x error is still refit after 5 steps at 8-12% noise
(tests/cost/test_refit.py). A slowdown every config shares (the job's own
planner beside compute, another process's load) is learnt once: when every config
that ran in the window's steps was off on the same side by more than the threshold,
two configs or more, and the steps' level (each step's median over its configs)
passes the same tests, every config of the model is scaled by that level, those
never run included; where seven refits of the demo chased one slowdown config by
config, one does. A scale keeps what
the profile measured about the shape of the cost (how a, b and c weigh long
against short documents), which a few steps of similar batches could not
separate, and corrects its level, which they measure well.

`refit_profile` writes the result as a `hydraulis.profile/1` file marked as
refit, kept beside the run and, for `profile = "auto"`, in the profile cache.
The refit is part of the run's state: a checkpoint keeps `OnlineRefit.state()`
(the refit configs' coefficients as the run plans with them, and the ratios
watched since), and a resume `restore`s it, so it plans as the run it
continues. No torch.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hydraulis.cost.conditions import Conditions
from hydraulis.cost.model import Coefficients, CostModel
from hydraulis.errors import HydraulisError
from hydraulis.files import Fields
from hydraulis.parallel import ParallelConfig

REFIT_ERROR = 0.15  # |predicted - measured| / measured beyond which a step counts as off
REFIT_STEPS = 5  # the steps in a row watched: all but one off on the same side, and a config is refit
# The window's median log ratio must lie this many robust standard errors (1.2533 x 1.4826 x MAD / sqrt(n))
# from 0: a bias of 20% with steps scattering 10% (log) passes, a window that half ran beside a burst of load not.
SPREAD_MULTIPLE = 3.0
SCATTER_STEPS = 20  # the steps whose scatter measures the noise (a window's own would be chosen by the rule)
COMMON_CONFIGS = 2  # configs that must share a window's level before every config is scaled by it


@dataclass(frozen=True)
class Refit:
    """A refit cost model, the step it was made after, and each refit config's scale of (a, b, c)."""

    cost: CostModel
    step: int
    scales: dict[ParallelConfig, float]
    common: bool = False  # every config by one scale: a slowdown the configs that ran shared

    def line(self, window: int = REFIT_STEPS) -> str:
        parts = ", ".join(f"{c.name} x{s:.2f}" for c, s in self.scales.items())
        if self.common:
            k = next(iter(self.scales.values()))
            parts = f"every config x{k:.2f} (a level the configs that ran shared)"
        return (
            f"cost model refit after step {self.step}: {parts} (predicted replica times were more than "
            f"{REFIT_ERROR:.0%} off in {window - 1} of {window} steps); planning with the refit model from here"
        )


@dataclass(frozen=True)
class RefitState:
    """What a checkpoint keeps of the online refit (JSON in its manifest): a resume plans with it."""

    step: int | None  # the last refit's step; None: no refit yet
    coefficients: dict[ParallelConfig, Coefficients]  # each refit config's, as the run plans with them
    ratios: dict[ParallelConfig, tuple[float, ...]]  # measured / predicted per step since its last refit
    scatter: dict[ParallelConfig, tuple[float, ...]] = field(default_factory=dict)  # OnlineRefit.scatter
    steps: tuple[dict[ParallelConfig, float], ...] = ()  # OnlineRefit.steps (the common level's window)
    common: tuple[float, ...] = ()  # OnlineRefit.common

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "coefficients": {c.name: [co.a, co.b, co.c] for c, co in self.coefficients.items()},
            "ratios": {c.name: list(r) for c, r in self.ratios.items()},
            "scatter": {c.name: list(r) for c, r in self.scatter.items()},
            "steps": [{c.name: r for c, r in s.items()} for s in self.steps],
            "common": list(self.common),
        }

    @classmethod
    def from_json(cls, data: Any, where: str) -> RefitState:
        """`to_json`'s form, checked (errors name `where`)."""
        f = Fields(data, where)
        step = None if f.data.get("step") is None else f.int("step", minimum=0)
        coefficients = {}
        for name in f.obj("coefficients").data:
            abc = f.obj("coefficients").float_list(name, minimum=0.0)
            if len(abc) != 3:
                raise HydraulisError(f"{where}.coefficients.{name}: expected [a, b, c], got {abc}")
            coefficients[_config(name, where)] = Coefficients(*abc)
        ratios = {_config(n, where): tuple(f.obj("ratios").float_list(n, minimum=0.0)) for n in f.obj("ratios").data}
        held = f.obj("scatter") if "scatter" in f.data else None  # absent before 2026-12-06
        scatter = {_config(n, where): tuple(held.float_list(n)) for n in held.data} if held is not None else {}
        steps = []  # absent, as "common", before 2026-12-07
        for i, row in enumerate(f.list("steps") if "steps" in f.data else []):
            one = Fields(row, f"{where}.steps[{i}]")
            steps.append({_config(n, where): one.float(n, minimum=0.0) for n in one.data})
        common = tuple(f.float_list("common")) if "common" in f.data else ()
        return cls(step, coefficients, ratios, scatter, tuple(steps), common)


def _config(name: str, where: str) -> ParallelConfig:
    try:
        return ParallelConfig.parse(name)
    except HydraulisError:
        raise HydraulisError(f"{where}: {name!r} is not a parallel config like 'tp2pp1'") from None


class OnlineRefit:
    """Watches predicted against measured replica times, step by step, and refits configs that stay off."""

    def __init__(self, cost: CostModel, window: int = REFIT_STEPS, threshold: float = REFIT_ERROR) -> None:
        self.cost = cost
        self.window = window
        self.threshold = threshold
        self.ratios: dict[ParallelConfig, list[float]] = {}  # measured / predicted per step, since the last refit
        self.scales: dict[ParallelConfig, float] = {}  # the product of every refit so far, per config
        self.step: int | None = None  # the last refit's step
        # log(measured / predicted by the profile the run started from), the last SCATTER_STEPS steps
        self.scatter: dict[ParallelConfig, list[float]] = {}
        self.steps: list[dict[ParallelConfig, float]] = []  # each config's ratio, the last `window` steps since a refit
        self.common: list[float] = []  # each step's median over its configs of their `scatter` entries

    def observe(
        self, step: int, configs: Sequence[ParallelConfig], measured: Sequence[float], predicted: Sequence[float]
    ) -> Refit | None:
        """One step's replica times; a Refit when the configs' common level (`common_level`), or else some
        config's last `window` steps, show a level `off_level` accepts."""
        per_config: dict[ParallelConfig, list[float]] = {}
        for config, m, p in zip(configs, measured, predicted, strict=True):
            if m > 0 and p > 0:  # a replica without micro-batches predicts nothing
                per_config.setdefault(config, []).append(m / p)
        due: dict[ParallelConfig, float] = {}
        for config, ratios in per_config.items():
            history = self.ratios.setdefault(config, [])
            history.append(float(np.median(ratios)))
            scatter = self.scatter.setdefault(config, [])
            scatter.append(float(np.log(history[-1] * self.scales.get(config, 1.0))))
            del history[: -SCATTER_STEPS], scatter[: -SCATTER_STEPS]
            level = off_level(history, scatter, self.window, self.threshold)
            if level is not None:
                due[config] = level
        if per_config:
            self.steps.append({c: self.ratios[c][-1] for c in per_config})
            self.common.append(float(np.median([self.scatter[c][-1] for c in per_config])))
            del self.steps[: -self.window], self.common[: -SCATTER_STEPS]
        level = common_level(self.steps, self.common, self.window, self.threshold)
        if level is not None:
            return self._refit(step, dict.fromkeys(self.cost.configs, level), common=True)
        return self._refit(step, due) if due else None

    def _refit(self, step: int, due: dict[ParallelConfig, float], common: bool = False) -> Refit:
        """Scale each due config's (a, b, c); its watch starts again, and the common one's too."""
        coefficients = {}
        for config in self.cost.configs:
            co = self.cost.coefficients(config)
            k = due.get(config, 1.0)
            coefficients[config] = Coefficients(co.a * k, co.b * k, co.c * k)
        # The coefficients read above already carry the recompute factor; with_configs keeps the set as it is.
        self.cost = self.cost.with_configs(refit_name(self.cost.name), coefficients, self.cost.recompute)
        for config, k in due.items():
            self.scales[config] = self.scales.get(config, 1.0) * k
            self.ratios[config] = []
        self.steps = []
        self.step = step
        return Refit(self.cost, step, dict(due), common)

    def state(self) -> RefitState:
        """What a checkpoint keeps: the refit configs' coefficients now, and the ratios watched since."""
        coefficients = {c: self.cost.coefficients(c) for c in self.scales}
        return RefitState(self.step, coefficients, {c: tuple(r) for c, r in self.ratios.items()},
                          {c: tuple(r) for c, r in self.scatter.items()}, tuple(dict(s) for s in self.steps),
                          tuple(self.common))

    def restore(self, state: RefitState) -> Refit | None:
        """Continue from a checkpoint's state: its refit configs get its coefficients (whatever this run's
        model started from: a refit profile already in the cache included); a Refit when any was refit.

        Configs this model does not know are left out (a resume on another pool)."""
        known = set(self.cost.configs)
        self.ratios = {c: list(r) for c, r in state.ratios.items() if c in known}
        kept = {c: co for c, co in state.coefficients.items() if c in known}
        self.step = state.step
        self.scatter = {c: list(r) for c, r in state.scatter.items() if c in known}
        self.steps = [{c: r for c, r in s.items() if c in known} for s in state.steps]
        self.common = list(state.common)
        if not kept:
            return None
        coefficients = {c: kept.get(c, self.cost.coefficients(c)) for c in self.cost.configs}
        for config, co in kept.items():
            base = self.cost.coefficients(config)
            total = base.a + base.b + base.c
            self.scales[config] = (co.a + co.b + co.c) / total if total > 0 else 1.0
        self.cost = self.cost.with_configs(refit_name(self.cost.name), coefficients, self.cost.recompute)
        return Refit(self.cost, state.step if state.step is not None else 0, dict(self.scales))


def off_level(
    ratios: Sequence[float], scatter: Sequence[float], window: int = REFIT_STEPS, threshold: float = REFIT_ERROR
) -> float | None:
    """The level (median measured / predicted) a config's last `window` steps (`ratios`, since its last refit)
    call for, or None when they are not evidence of a wrong level: fewer steps, more than one within
    `threshold` or on the other side, or a median within `SPREAD_MULTIPLE` robust standard errors of 1, by the
    noise of `scatter` (log ratios of its recent steps: a robust spread, 1.4826 x their median deviation)."""
    recent = np.asarray(ratios[-window:], dtype=float)
    if len(recent) < window:
        return None
    errors = 1 / recent - 1  # (predicted - measured) / measured
    off = max(int((errors > threshold).sum()), int((errors < -threshold).sum()))
    if off < window - 1:
        return None
    middle = float(np.median(np.log(recent)))
    logs = np.asarray(scatter, dtype=float)
    spread = 1.4826 * float(np.median(np.abs(logs - np.median(logs)))) if len(logs) else 0.0
    if abs(middle) < SPREAD_MULTIPLE * 1.2533 * spread / np.sqrt(window):
        return None
    return float(np.exp(middle))


def common_level(
    steps: Sequence[dict[ParallelConfig, float]], common: Sequence[float], window: int = REFIT_STEPS,
    threshold: float = REFIT_ERROR,
) -> float | None:
    """The level every config shares in the last `window` `steps` (each a dict of the configs that ran and their
    measured / predicted), or None: fewer than `COMMON_CONFIGS` configs ran, one of them was not off by more than
    `threshold` on the level's side (its median), or the steps' medians are no level by `off_level` (its
    scatter: `common`, each step's median log ratio against the starting profile)."""
    recent = steps[-window:]
    if len(recent) < window:
        return None
    level = off_level([float(np.median(list(s.values()))) for s in recent], common, window, threshold)
    ran = {c for s in recent for c in s}
    if level is None or len(ran) < COMMON_CONFIGS:
        return None
    for config in ran:
        error = 1 / float(np.median([s[config] for s in recent if config in s])) - 1
        if not (error < -threshold if level > 1 else error > threshold):
            return None
    return level


def refit_name(name: str) -> str:
    """A refit model's or profile's name: marked once, however often it is refit."""
    return name if name.endswith("(refit)") else f"{name} (refit)"


def refit_profile(
    data: dict[str, Any], scales: dict[ParallelConfig, float], source: str, step: int, conditions: Conditions
) -> dict[str, Any]:
    """The profile `data` with each refit config's a, b, c scaled, marked as refit (from what run, and when),
    under the conditions of the run that refit it."""
    out = copy.deepcopy(data)
    names = {c.name: k for c, k in scales.items()}
    for row in out["time_ms"]:
        k = names.get(ParallelConfig(row["tp"], row["pp"], row.get("cp", 1)).name)
        if k is not None:
            row["a"], row["b"], row["c"] = row["a"] * k, row["b"] * k, row["c"] * k
    out["name"] = refit_name(str(data["name"]))
    out["refit"] = {"source": source, "step": step, "scales": names}
    out["conditions"] = conditions.to_json()
    return out
