"""The measured comparison after a run: the recent batches again, as planned and on each homogeneous deployment.

Real iterations (gather, 1F1B, reduce, AdamW), timed as `Trainer.run_schedule`
times them, interleaved variant by variant; the optimizer state and step index
are restored afterwards, so training is unchanged. It is the run's own
benchmark, apart from the step: the trainer only keeps the batches
(`TrainSettings.compare_steps`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from hydraulis.data.sampler import GlobalBatch
from hydraulis.errors import HydraulisError
from hydraulis.planner.plan import Schedule, decode_plan, encode_plan
from hydraulis.runtime.optimizer.sharded import ShardedOptimizer
from hydraulis.runtime.plan_feed import PlanFeed


@dataclass(frozen=True)
class Comparison:
    """The same batches as planned and on each homogeneous deployment: measured and predicted seconds."""

    tokens: int
    repeats: int
    measured_s: dict[str, list[float]]  # per variant ("planned" or a deployment), one total per repeat
    predicted_s: dict[str, float]

    def median(self, name: str) -> float:
        return float(np.median(self.measured_s[name]))

    @property
    def best_homogeneous(self) -> str:
        return min((k for k in self.measured_s if k != "planned"), key=self.median)

    def to_dict(self) -> dict:
        best = self.best_homogeneous
        return {
            "tokens": self.tokens,
            "repeats": self.repeats,
            "measured_s": self.measured_s,
            "predicted_s": self.predicted_s,
            "best_homogeneous": best,
            "measured_speedup": self.median(best) / self.median("planned"),
            "predicted_speedup": self.predicted_s[best] / self.predicted_s["planned"],
        }


def compare(
    run: Callable[[GlobalBatch, Schedule], Any], feed: PlanFeed, optimizer: ShardedOptimizer,
    pairs: Sequence[tuple[GlobalBatch, Schedule]], repeats: int = 3,
) -> Comparison | None:
    """The recent batches and their schedules (`pairs`) again, as planned and on each homogeneous deployment of
    the pool, each run by `run` (the trainer's iteration); the feed plans (rank 0) and broadcasts them, and its step
    and the optimizer's state are restored afterwards.

    Returns None when no batch was kept or no homogeneous deployment holds them all. A deployment that
    could not hold some batch of the run is left out: a homogeneous run could not have used it (under
    `[parallel] memory_per_rank`, the comparison is with the homogeneous plans that fit the budget).
    """
    if not pairs:
        return None
    pool, planner = feed.pool, feed.planner
    candidates = [k for k, d in enumerate(pool) if d.is_homogeneous]  # that held every batch of the run:
    candidates = [k for k in candidates if planner is None or k not in planner.missed]
    payload, made = None, {}
    if planner is not None:
        for k in candidates:  # a deployment that cannot hold every batch (within the caps) is left out
            with contextlib.suppress(HydraulisError):
                made[k] = [encode_plan(planner.plan_on(b.lengths, pool[k], p.step), k) for b, p in pairs]
        payload = np.array([len(made), *made], dtype=np.int64)
    usable = [int(k) for k in feed.broadcast(payload)[1:]]
    if not usable:
        return None
    # Rank 0 made them; every rank receives them all, then decodes them.
    received = {k: [feed.broadcast(m) for m in made.get(k, [None] * len(pairs))] for k in usable}
    plans: dict[str, list[Schedule]] = {"planned": [p for _, p in pairs]}
    for k, payloads in received.items():
        plans[str(pool[k])] = [Schedule.single(decode_plan(data, p.step, b.lengths, pool))
                               for data, (b, p) in zip(payloads, pairs, strict=True)]
    saved = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in optimizer.state_dict().items()}
    step = feed.step
    seconds: dict[str, list[float]] = {name: [] for name in plans}
    for _ in range(repeats):
        for name, chosen in plans.items():
            feed.step = step
            rows = [run(b, p) for (b, _), p in zip(pairs, chosen, strict=True)]
            seconds[name].append(sum(r.iteration_s for r in rows))
    feed.step = step
    optimizer.load_state_dict(saved)
    tokens = sum(b.num_tokens for b, _ in pairs)
    predicted = {name: sum(p.iteration_time_s for p in chosen) for name, chosen in plans.items()}
    return Comparison(tokens, repeats, seconds, predicted)
