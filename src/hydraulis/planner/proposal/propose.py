"""`propose`: the pool, built greedily from candidates planned on sample batches (see the package docstring)."""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hydraulis.cost.model import CostModel
from hydraulis.errors import HydraulisError
from hydraulis.limits import DEFAULT_MAX_POOL
from hydraulis.parallel import Deployment
from hydraulis.planner.plan import Schedule
from hydraulis.planner.pool import (
    Pool,
    candidate_deployments,
    fallback_config,
    fallback_deployment,
    homogeneous,
    unique_deployments,
)
from hydraulis.planner.proposal.phased import long_phase_deployments, phase_deployments, trial_planner
from hydraulis.planner.proposal.range_dp import LengthHistogram, dp_deployments
from hydraulis.planner.proposal.refine import refine
from hydraulis.planner.proposal.screen import (
    LARGE_BATCH_SCREEN,
    Progress,
    plan_times,
    screen_candidates,
    worker_memo,
)
from hydraulis.planner.replicas import BULK_MIN_SEQUENCES
from hydraulis.processes.fan_out import fan_out
from hydraulis.specs import ClusterSpec

METHODS = ("hydraulis", "published")


@dataclass(frozen=True)
class Proposal:
    pool: Pool
    method: str
    candidates: tuple[Deployment, ...]
    times_s: np.ndarray  # [pool deployments, sample batches]: planned iteration time, inf if it cannot hold
    sample_tokens: np.ndarray  # tokens of each sample batch
    elapsed_s: float
    phased_times_s: np.ndarray | None = None  # [sample batches]: the phased planner's iteration on the pool
    tokens_on: np.ndarray | None = None  # [pool deployments, sample batches]: tokens each runs, whole or in phases

    @property
    def best_times_s(self) -> np.ndarray:
        best = self.times_s.min(axis=0)
        return best if self.phased_times_s is None else np.minimum(best, self.phased_times_s)

    @property
    def throughput(self) -> float:
        """Tokens per second over the sample batches, the planner choosing per batch."""
        return float(self.sample_tokens.sum() / self.best_times_s.sum())

def _dp_candidates(cost: CostModel, cluster: ClusterSpec, hist: LengthHistogram, aware: bool) -> list[Deployment]:
    """The range programme's deployments, with the data-aware group time or the published one."""
    return [d for _, d in dp_deployments(cost, cluster, hist, aware=aware)]

def greedy_pool(times: np.ndarray, first: int, max_pool: int, min_gain: float = 0.002) -> list[int]:
    """Row indices: `first`, then the rows that most lower sum over batches of the row-wise minimum."""
    chosen = [first]
    best = times[first].copy()
    while len(chosen) < max_pool:
        gain = np.where(np.isfinite(best), best, 1e30)[None, :] - np.minimum(times, best[None, :])
        gain = np.where(np.isfinite(gain), gain, 0.0).sum(axis=1)
        gain[chosen] = -np.inf
        k = int(np.argmax(gain))
        if gain[k] <= min_gain * float(best[np.isfinite(best)].sum()):
            break
        chosen.append(k)
        best = np.minimum(best, times[k])
    return chosen


def default_samples(batches: Sequence[np.ndarray]) -> int:
    """Planning cost grows with the batch: fewer samples for larger jobs keep proposal within a minute."""
    tokens = float(np.mean([b.sum() for b in batches]))
    return int(np.clip(4e6 / max(tokens, 1.0), 4, 16))


def _published(
    cost: CostModel, cluster: ClusterSpec, hist: LengthHistogram, fallback: Deployment, max_pool: int
) -> list[Deployment]:
    """The published generator's pool: one deployment per batch maximum length, the fallback first."""
    found = unique_deployments([fallback] + [d for _, d in dp_deployments(cost, cluster, hist, aware=False)])
    if len(found) > max_pool:
        # One deployment per batch maximum length; keep the fallback and evenly spread maxima.
        keep = np.unique(np.linspace(1, len(found) - 1, max_pool - 1).round().astype(int))
        found = [found[0]] + [found[i] for i in keep]
    return found


def _fallback(
    method: str, cost: CostModel, cluster: ClusterSpec, longest: int, batches: Sequence[np.ndarray]
) -> Deployment:
    """The pool's first deployment, which holds `longest`. The published system knows no lone micro-batches:
    its fallback holds the longest sequence by the cap."""
    if method == "hydraulis":
        return fallback_deployment(cost, cluster, longest, batches)
    return homogeneous(fallback_config(cost, cluster, longest, batches, lone=False), cluster)


def propose(
    cost: CostModel,
    cluster: ClusterSpec,
    batches: Sequence[np.ndarray],
    max_pool: int = DEFAULT_MAX_POOL,
    method: str = "hydraulis",
    max_samples: int | None = None,
    screen: int = 10,
    max_length: int | None = None,
    progress: Progress | None = None,
) -> Proposal:
    """Propose a pool of at most `max_pool` deployments for batches like `batches`; the fallback holds
    `max_length` (default: the longest sampled sequence)."""
    start, memo = time.perf_counter(), {}  # memo: the samples' plans on the candidates, which the phases' greedy reads
    if method not in METHODS:
        raise HydraulisError(f"unknown proposal method {method!r}; use one of {', '.join(METHODS)}")
    if max_pool < 1:
        raise HydraulisError(f"--max-pool must be at least 1, got {max_pool}")
    batches = [np.asarray(b, dtype=np.int64) for b in batches if len(b)]
    if not batches:
        raise HydraulisError("cannot propose a pool without sample batches")
    hist = LengthHistogram.from_batches(batches)
    longest = max(hist.max_length, max_length or 0)
    fallback = _fallback(method, cost, cluster, longest, batches)
    sample = batches[: max_samples or default_samples(batches)]

    if method == "published":
        candidates = _published(cost, cluster, hist, fallback, max_pool)
        times = plan_times(cost, cluster, candidates, sample, progress)
        pool_idx = list(range(len(candidates)))
    else:
        aware, published = fan_out(functools.partial(_dp_candidates, cost, cluster, hist), [True, False],
                                   memo=worker_memo(cost))
        every = candidates = unique_deployments(
            [fallback] + aware + published + candidate_deployments(cost, cluster, longest, sample[:4])
        )
        if np.mean([len(b) for b in sample]) >= BULK_MIN_SEQUENCES:
            # Large batches of light sequences: the dispatch estimate ranks as planning would, and each
            # planned candidate costs seconds, so fewer survive the screen.
            screen = min(screen, LARGE_BATCH_SCREEN)
        kept = screen_candidates(cost, cluster, candidates, sample, screen)  # sorted: the fallback first where kept
        candidates = [candidates[i] for i in dict.fromkeys([0, *kept])]
        times_all = plan_times(cost, cluster, candidates, sample, progress, memo=memo)
        candidates, times_all = refine(cost=cost, cluster=cluster, candidates=candidates, times=times_all,
                                       batches=sample, longest=longest, budget=len(candidates), memo=memo)
        pool_idx = greedy_pool(times_all, 0, max_pool)
        times = times_all[pool_idx]
    pool_deployments = tuple(candidates[i] for i in pool_idx)
    sample_tokens = np.array([float(b.sum()) for b in sample])
    tokens_on = np.eye(len(pool_deployments))[np.argmin(times, axis=0)].T * sample_tokens  # whole, on the fastest
    phased = None
    if method == "hydraulis" and max_pool > 1:
        # The whole-batch choices compete with the phases' for the pool's room, on the phased planner's time.
        pool_deployments, schedules = _phased_pool(cost=cost, cluster=cluster, every=every, chosen=pool_deployments,
                                                   sample=sample, max_pool=max_pool, memo=memo)
        phased = np.array([s.iteration_time_s for s in schedules])
        tokens_on = tokens_per_deployment(pool_deployments, schedules)
        rows = {str(d): times_all[k] for k, d in enumerate(candidates)}
        times = np.array([rows.get(str(d), np.full(len(sample), np.inf)) for d in pool_deployments])
    usage = tuple(float(t) for t in tokens_on.sum(axis=1) / tokens_on.sum())
    return Proposal(
        pool=Pool(cost.name, cluster, pool_deployments, usage),
        method=method,
        candidates=tuple(candidates),
        times_s=times,
        sample_tokens=sample_tokens,
        elapsed_s=time.perf_counter() - start,
        phased_times_s=phased,
        tokens_on=tokens_on,
    )


def _phased_pool(
    cost: CostModel, cluster: ClusterSpec, every: list[Deployment], chosen: tuple[Deployment, ...],
    sample: list[np.ndarray], max_pool: int, memo: dict,
) -> tuple[tuple[Deployment, ...], list[Schedule]]:
    """The pool from the fallback and the whole samples' choices (`chosen`): the phases' deployments
    (`phase_deployments`), less those left idle (`_without_idle`), then the long phases' (`long_phase_deployments`,
    which only add); and the phased planner's schedule of each sample on it. `memo`: the samples' plans so far
    (`plan_times`'), shared by the two passes."""
    extra, schedules = phase_deployments(cost, cluster, every, chosen[:1], sample, max_pool=max_pool,
                                         whole=chosen[1:], memo=memo)
    pool, schedules = _without_idle(cost, cluster, (chosen[0], *extra), schedules, sample)
    longer, schedules = long_phase_deployments(cost, cluster, pool, sample, schedules, max_pool=max_pool, memo=memo)
    return (*pool, *longer), schedules


def tokens_per_deployment(pool: Sequence[Deployment], schedules: Sequence[Schedule]) -> np.ndarray:
    """[pool deployments, batches]: the tokens of each batch each deployment runs (whole, or in its phases)."""
    out = np.zeros((len(pool), len(schedules)))
    for j, schedule in enumerate(schedules):
        for plan in schedule.phases:
            out[pool.index(plan.deployment), j] += plan.num_tokens
    return out


def _without_idle(
    cost: CostModel, cluster: ClusterSpec, pool: tuple[Deployment, ...], schedules: list[Schedule],
    sample: Sequence[np.ndarray],
) -> tuple[tuple[Deployment, ...], list[Schedule]]:
    """The pool less the deployments, but the fallback, that run no sample's tokens (later ones took theirs over),
    the samples planned again, where no slower: the phased planner cuts batches at the pool's caps."""
    used = {str(plan.deployment) for s in schedules for plan in s.phases}
    kept = tuple(d for k, d in enumerate(pool) if k == 0 or str(d) in used)
    if len(kept) == len(pool):
        return pool, schedules
    planner = trial_planner(cost, cluster.num_gpus, list(kept))
    again = [planner.schedule(b) for b in sample]
    if sum(s.iteration_time_s for s in again) <= sum(s.iteration_time_s for s in schedules) * (1 + 1e-9):
        return kept, again
    return pool, schedules
