"""The measured comparison after a run: the recent batches again, as planned and on each homogeneous deployment.

Real iterations (gather, 1F1B, reduce, AdamW), timed as `Trainer.run_schedule`
times them; the optimizer state and step index are restored afterwards, so
training is unchanged. It is the run's own benchmark, apart from the step:
the trainer only keeps the batches (`TrainSettings.compare_steps`, hydraulis/settings.py).

Interleaved batch by batch: each batch runs on every variant back to back
(the order alternating, A B then B A), so a burst of other work hits the
variants of a batch alike, and each variant's time is the sum over the
batches of its median over the repeats, so one disturbed repeat of a batch
moves nothing. Timing the variants block after block (all batches on A, then
all on B) let one busy stretch land on one block: beside other work on 2
cores the demo measured 0.92x and 1.03x where quiet runs measured 1.37x.
Running a batch right after another variant's switches deployments where the
variant's own sequence would not: that activation (`StepMetrics.switch_s`)
is taken out, and charged where its own sequence switches (`charged`).

Beside wall time, the CPU time of the ranks (their processes', summed over
ranks): the work a variant does, which other processes' load does not
stretch (gloo's collectives block rather than spin: a rank waiting 2 s in
an all-reduce used 4 ms of CPU). On a machine whose cores other work takes,
wall time is the cores' share, and the balance that makes the planned run
faster quiet counts for less; the CPU time says what each variant costs.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from hydraulis.data.sampler import GlobalBatch
from hydraulis.errors import HydraulisError
from hydraulis.planner.plan import Schedule, decode_plan, encode_plan
from hydraulis.runtime.optimizer.sharded import ShardedOptimizer
from hydraulis.runtime.plan_feed import PlanFeed

Timed = tuple[float, float | None]  # an iteration's seconds, and its switch's (None: it did not switch)


@dataclass(frozen=True)
class Comparison:
    """The same batches as planned and on each homogeneous deployment: measured and predicted seconds."""

    tokens: int
    repeats: int
    batch_s: dict[str, list[list[float]]]  # per variant ("planned" or a deployment): [repeat][batch] seconds
    predicted_s: dict[str, float]
    cpu_s: dict[str, list[list[float]]] | None = None  # the ranks' CPU seconds, summed over ranks, likewise

    def median(self, name: str, cpu: bool = False) -> float:
        """A variant's time for the batches (`cpu`: the ranks' CPU time): per batch the median over the
        repeats, summed."""
        times = self.cpu_s if cpu and self.cpu_s is not None else self.batch_s
        return float(np.median(np.asarray(times[name]), axis=0).sum())

    @property
    def best_homogeneous(self) -> str:
        return min((k for k in self.batch_s if k != "planned"), key=self.median)

    def to_dict(self) -> dict:
        best = self.best_homogeneous
        repeats = np.asarray(self.batch_s[best]).sum(axis=1) / np.asarray(self.batch_s["planned"]).sum(axis=1)
        return {
            "tokens": self.tokens,
            "repeats": self.repeats,
            "measured_s": {k: [float(x) for x in np.asarray(v).sum(axis=1)] for k, v in self.batch_s.items()},
            "median_s": {k: self.median(k) for k in self.batch_s},
            "predicted_s": self.predicted_s,
            "best_homogeneous": best,
            "measured_speedup": self.median(best) / self.median("planned"),
            "measured_speedup_per_repeat": [float(x) for x in repeats],
            "predicted_speedup": self.predicted_s[best] / self.predicted_s["planned"],
            **({} if self.cpu_s is None else {
                "cpu_s": {k: self.median(k, cpu=True) for k in self.cpu_s},
                "cpu_speedup": self.median(best, cpu=True) / self.median("planned", cpu=True),
            }),  # fmt: skip
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
    step, names = feed.step, list(plans)
    rows: dict[str, list[list[Timed]]] = {name: [[] for _ in range(repeats)] for name in names}
    cpu = np.zeros((len(names), repeats, len(pairs)))
    for r in range(repeats):
        for i, (batch, _) in enumerate(pairs):
            for name in names if (r + i) % 2 == 0 else names[::-1]:  # A B, then B A: neither always first
                feed.step = step + i
                began = time.process_time()
                m = run(batch, plans[name][i])
                cpu[names.index(name), r, i] = time.process_time() - began
                rows[name][r].append((m.iteration_s, m.switch_s if m.switched else None))
    feed.step = step
    optimizer.load_state_dict(saved)
    total = torch.from_numpy(cpu)
    if feed.world > 1:
        dist.all_reduce(total, group=feed.control)  # every rank's CPU time: the job's
    tokens = sum(b.num_tokens for b, _ in pairs)
    predicted = {name: sum(p.iteration_time_s for p in chosen) for name, chosen in plans.items()}
    return Comparison(tokens, repeats, charged(rows, {name: _switches(p) for name, p in plans.items()}), predicted,
                      {name: total[k].tolist() for k, name in enumerate(names)})


def _switches(chosen: Sequence[Schedule]) -> list[bool]:
    """Where a variant's own sequence switches deployments between iterations (not before its first)."""
    return [i > 0 and s.phases[0].deployment != chosen[i - 1].phases[-1].deployment for i, s in enumerate(chosen)]


def charged(rows: dict[str, list[list[Timed]]], own: dict[str, list[bool]]) -> dict[str, list[list[float]]]:
    """Each iteration's time as its variant's own sequence would have paid it (`own[name][batch]`: whether it
    switches there): a switch the interleaving caused is taken out, one its own sequence makes is kept (or,
    where the interleaving ran the same deployment just before, charged at the median switch measured)."""
    measured = [switch for v in rows.values() for repeat in v for _, switch in repeat if switch is not None]
    typical = float(np.median(measured)) if measured else 0.0
    out: dict[str, list[list[float]]] = {}
    for name, repeats in rows.items():
        switches = own[name]
        out[name] = [[t - (s if s is not None and not switches[i] else 0.0)
                      + (typical if switches[i] and s is None else 0.0) for i, (t, s) in enumerate(repeat)]
                     for repeat in repeats]  # fmt: skip
    return out
