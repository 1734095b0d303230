"""Online refit: a config whose predictions stay more than 15% off during training is refit from the run.

Why: a profile is taken once, under its own conditions (load from other
processes, another world size, a machine that changed); the trainer measures
every replica every step. When a config's replicas are off their
predicted times on the same side in all but one of `window` steps in a
row (one disturbed step on a shared machine does not restart the count:
on 2 cores a 17% bias waited 12 steps for 5 clean ones in a row), its
coefficients (a, b, c) are scaled by the median measured / predicted
ratio of those steps,
and the planner plans with the refit model from then on. A scale keeps what
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
from dataclasses import dataclass
from typing import Any

import numpy as np

from hydraulis.cost.conditions import Conditions
from hydraulis.cost.model import Coefficients, CostModel
from hydraulis.errors import HydraulisError
from hydraulis.files import Fields
from hydraulis.parallel import ParallelConfig

REFIT_ERROR = 0.15  # |predicted - measured| / measured beyond which a step counts as off
REFIT_STEPS = 5  # the steps in a row watched: all but one off on the same side, and a config is refit


@dataclass(frozen=True)
class Refit:
    """A refit cost model, the step it was made after, and each refit config's scale of (a, b, c)."""

    cost: CostModel
    step: int
    scales: dict[ParallelConfig, float]

    def line(self, window: int = REFIT_STEPS) -> str:
        parts = ", ".join(f"{c.name} x{s:.2f}" for c, s in self.scales.items())
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

    def to_json(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "coefficients": {c.name: [co.a, co.b, co.c] for c, co in self.coefficients.items()},
            "ratios": {c.name: list(r) for c, r in self.ratios.items()},
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
        return cls(step, coefficients, ratios)


def _config(name: str, where: str) -> ParallelConfig:
    try:
        return ParallelConfig.parse(name)
    except HydraulisError:
        raise HydraulisError(f"{where}: {name!r} is not a parallel config like 'tp2pp1'") from None


class OnlineRefit:
    """Watches predicted against measured replica times, step by step, and refits configs that stay off."""

    def __init__(self, cost: CostModel, window: int = REFIT_STEPS, threshold: float = REFIT_ERROR) -> None:
        self.cost, self.window, self.threshold = cost, window, threshold
        self.ratios: dict[ParallelConfig, list[float]] = {}  # measured / predicted per step, since the last refit
        self.scales: dict[ParallelConfig, float] = {}  # the product of every refit so far, per config
        self.step: int | None = None  # the last refit's step

    def observe(
        self, step: int, configs: Sequence[ParallelConfig], measured: Sequence[float], predicted: Sequence[float]
    ) -> Refit | None:
        """One step's replica times; a Refit when some config has now been off in all but one of `window` steps."""
        per_config: dict[ParallelConfig, list[float]] = {}
        for config, m, p in zip(configs, measured, predicted, strict=True):
            if m > 0 and p > 0:  # a replica without micro-batches predicts nothing
                per_config.setdefault(config, []).append(m / p)
        due: dict[ParallelConfig, float] = {}
        for config, ratios in per_config.items():
            history = self.ratios.setdefault(config, [])
            history.append(float(np.median(ratios)))
            recent = np.array(history[-self.window :])
            errors = 1 / recent - 1  # (predicted - measured) / measured
            off = max(int((errors > self.threshold).sum()), int((errors < -self.threshold).sum()))
            if len(recent) == self.window and off >= self.window - 1:
                due[config] = float(np.median(recent))
        if not due:
            return None
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
        self.step = step
        return Refit(self.cost, step, dict(due))

    def state(self) -> RefitState:
        """What a checkpoint keeps: the refit configs' coefficients now, and the ratios watched since."""
        coefficients = {c: self.cost.coefficients(c) for c in self.scales}
        return RefitState(self.step, coefficients, {c: tuple(r) for c, r in self.ratios.items()})

    def restore(self, state: RefitState) -> Refit | None:
        """Continue from a checkpoint's state: its refit configs get its coefficients (whatever this run's
        model started from: a refit profile already in the cache included); a Refit when any was refit.

        Configs this model does not know are left out (a resume on another pool)."""
        known = set(self.cost.configs)
        self.ratios = {c: list(r) for c, r in state.ratios.items() if c in known}
        kept = {c: co for c, co in state.coefficients.items() if c in known}
        self.step = state.step
        if not kept:
            return None
        coefficients = {c: kept.get(c, self.cost.coefficients(c)) for c in self.cost.configs}
        for config, co in kept.items():
            base = self.cost.coefficients(config)
            total = base.a + base.b + base.c
            self.scales[config] = (co.a + co.b + co.c) / total if total > 0 else 1.0
        self.cost = self.cost.with_configs(refit_name(self.cost.name), coefficients, self.cost.recompute)
        return Refit(self.cost, state.step if state.step is not None else 0, dict(self.scales))


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
