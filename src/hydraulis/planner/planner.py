"""Joint planning of one iteration: choose a deployment from the pool, dispatch, pack.

For every pool deployment that holds the batch's longest sequence, stage 1
dispatches by estimate; the most promising deployments are then packed
(stage 2) and simulated, and the fastest simulated plan wins. Packing feeds
back into dispatch: the gap between each replica's simulated and estimated
time becomes a per-replica bias and dispatch runs again, kept where that pays.
The plan's predicted time is the simulator's iteration time for it.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hydraulis.cost.activations import COUNT_HORIZON, count_horizon
from hydraulis.cost.model import CostModel
from hydraulis.data.sampler import split_pieces
from hydraulis.errors import HydraulisError, OverlongError
from hydraulis.limits import check_lengths
from hydraulis.parallel import Deployment
from hydraulis.planner.dispatch import BULK_MIN_SEQUENCES, Dispatch, NoRoom, dispatch, improve
from hydraulis.planner.milp import exact_assignment
from hydraulis.planner.packing import Packing, order_by_simulation, pack_replica
from hydraulis.planner.plan import IterationPlan
from hydraulis.planner.pool import largest_cap
from hydraulis.planner.replicas import ReplicaTable
from hydraulis.planner.schedule import Schedule, assemble, finalize  # finalize: the baselines' too
from hydraulis.planner.sim import simulate, work_bound
from hydraulis.specs import ClusterSpec

OVERLONG_POLICIES = ("auto", "error", "split", "truncate", "drop")
LARGE_BATCH_MARGIN = 0.02
# zero_bubble: candidates this far over the best fused time are deferred too (deferral gains up to 1.19x, results.md)
DEFER_MARGIN = 1.2
METHODS = ("heuristic", "milp")


@dataclass(frozen=True)
class CappedBatch:
    lengths: np.ndarray  # the batch after the policy
    changed: int  # sequences truncated or dropped


def apply_overlong(
    lengths: np.ndarray, cap: int, cap_name: str, policy: str, where: str = "batch",
    remedies: tuple[str, ...] = ("a pool with larger (CP) replicas", "more GPUs"), cp_profile: str | None = None,
) -> CappedBatch:
    """Sequences longer than `cap`, the largest cap of the pool (CP replicas included).

    auto (default; `error` is its older name): every sequence the pool holds stays whole, even when
    only a CP replica holds it; a longer one is an error naming its length and the cap. split:
    consecutive pieces of at most the cap (what the sampler does at max_len); truncate: cut to the
    cap; drop: leave out.
    """
    if policy not in OVERLONG_POLICIES:
        raise HydraulisError(f"unknown overlong policy {policy!r}; use one of {', '.join(OVERLONG_POLICIES)}")
    over = lengths > cap
    if not over.any():
        return CappedBatch(lengths, 0)
    if policy in ("auto", "error"):
        raise OverlongError(int(lengths[over].max()), cap, cap_name, where=where, remedies=remedies,
                            cp_profile=cp_profile)
    if policy == "split":
        return CappedBatch(split_pieces(lengths, cap)[2], int(over.sum()))
    if policy == "truncate":
        return CappedBatch(np.minimum(lengths, cap), int(over.sum()))
    kept = lengths[~over]
    if len(kept) == 0:
        raise HydraulisError(f"{where}: every sequence is longer than the largest cap {cap} ({cap_name})")
    return CappedBatch(kept, int(over.sum()))


@dataclass(frozen=True)
class Candidate:
    """One deployment planned for one batch."""

    deployment: Deployment
    micro_batches: tuple[tuple[np.ndarray, ...], ...]  # per replica, in execution order
    replica_times_s: np.ndarray

    @property
    def compute_s(self) -> float:
        return float(self.replica_times_s.max())


class Planner:
    """Plans global batches on a pool of deployments (the Policy for `hydraulis`)."""

    name = "hydraulis"

    def __init__(
        self,
        cost: CostModel,
        num_gpus: int,
        pool: Sequence[Deployment],
        *,
        method: str = "heuristic",
        milp_time_limit_s: float = 5.0,
        full_candidates: int = 3,
        refine_rounds: int = 1,  # a second round changed no bench plan but one batch's, by 0.0003% (results.md)
        memo: dict | None = None,
        zero_bubble: bool = False,  # defer the weight gradients where that is faster (`finalize`)
    ) -> None:
        if method not in METHODS:
            raise HydraulisError(f"unknown dispatch method {method!r}; use one of {', '.join(METHODS)}")
        if not pool:
            raise HydraulisError("the deployment pool is empty")
        for d in pool:
            if d.num_gpus != num_gpus:
                raise HydraulisError(f"pool deployment {d} uses {d.num_gpus} GPUs but the job has {num_gpus}")
        self.cost = cost
        self.num_gpus = num_gpus
        self.pool = tuple(pool)
        self.method = method
        self.milp_time_limit_s = milp_time_limit_s
        self.full_candidates = full_candidates
        self.refine_rounds = refine_rounds
        self.zero_bubble = zero_bubble
        self._by_horizon: dict[tuple[int, ...], list[ReplicaTable]] = {}  # the pool's tables per horizon
        self._interleaved = tuple({g for d in self.pool for g in d.configs if g.vp > 1})
        # (deployment, lengths) -> its greedy dispatch, or its packed candidate and simulated time: shared by
        # planners of one cost model on pools that overlap (the proposal's trials), which plan alike
        self._memo = memo
        self.missed: set[int] = set()  # pool deployments that could not hold some batch planned so far
        # Per planned step, each pool deployment's predicted time over the chosen one's (inf: it could not hold
        # the batch): why a run kept one deployment (training/run_log.py). Shared with a refit's planner.
        self.outlook: dict[int, tuple[float, ...]] = {}
        self._last_outlook: tuple[float, ...] = ()

    def with_cost(self, cost: CostModel) -> Planner:
        """This planner on another cost model (the online refit's), keeping what the run recorded so far: the
        deployments that missed a batch (the comparison leaves those out) and the outlook."""
        other = type(self)(cost, self.num_gpus, self.pool, method=self.method,
                           milp_time_limit_s=self.milp_time_limit_s, full_candidates=self.full_candidates,
                           refine_rounds=self.refine_rounds, zero_bubble=self.zero_bubble)
        other.missed = self.missed  # the same records
        other.outlook = self.outlook
        return other

    def plan(self, lengths: Sequence[int] | np.ndarray, step: int = 0, *, outlook: bool = True) -> IterationPlan:
        """The fastest plan (by simulation) over the pool deployments that hold the batch. `outlook` False (a
        phase's plan, whose view of the pool no step keeps): a deployment is packed only until it surely loses."""
        start = time.perf_counter()
        lengths = check_lengths(lengths)
        longest = int(lengths.max())
        usable = [k for k, t in enumerate(self._tables_for(lengths)) if int(t.lone_cap.max()) >= longest]
        self.missed.update(set(range(len(self.pool))) - set(usable))
        if not usable:
            cap, name = largest_cap(self.cost, ClusterSpec(self.num_gpus), self.pool)
            raise OverlongError(longest, cap, name, scope="in the pool", remedies=("a pool with larger (CP) replicas",))
        # Screen the pool with the greedy alone; search, pack and simulate the most promising.
        screened = []
        for k in usable:
            try:
                screened.append((self._greedy(lengths, k), k))
            except NoRoom:  # more sequences beyond the caps than lone micro-batches to hold them
                self.missed.add(k)
        if not screened:
            raise HydraulisError(
                "no deployment of the pool has room for this batch: a sequence longer than a replica's cap runs "
                f"alone on it, and too many are; use a pool with more replicas that hold {longest} tokens"
            )
        screened.sort(key=lambda x: x[0].makespan_s)
        best: Candidate | None = None
        best_s = float("inf")
        simulated: dict[int, float] = {}
        kept: list[tuple[Candidate, float]] = []
        for d, k in self._worth_packing(screened, len(lengths)):
            bound = self._bound(lengths, k) if best is not None else 0.0
            if bound > best_s * (1 + 1e-9):  # no plan on it can beat the best simulated so far: not packed, and
                simulated[k] = bound  # the outlook counts it at least this slow (like against like, not its estimate)
                continue
            lose = np.inf if outlook or best is None else (best_s - self.cost.step_time(self.pool[k].configs))
            found = self._packed(lengths, k, d, lose * (1 + 1e-9))  # None: surely slower (a margin over rounding)
            simulated.update({} if found is None else {k: found[1]})
            kept += [] if found is None else [found]
            best, best_s = found if found is not None and found[1] < best_s else (best, best_s)
        assert best is not None
        if outlook:
            self._last_outlook = _relative(self.pool.index(best.deployment), len(self.pool), simulated,
                                           {k: d.makespan_s for d, k in screened})
        if self.method == "milp":
            best = self._exact(lengths, best)
        if self.zero_bubble and self.method != "milp":  # the deferred times may rank the candidates otherwise
            return dataclasses.replace(self._deferred(step, lengths, kept, best_s * DEFER_MARGIN, start),
                                       planning_time_s=time.perf_counter() - start)
        return self._finish(step, lengths, best, start)

    def _deferred(self, step: int, lengths: np.ndarray, kept: list[tuple[Candidate, float]], within: float,
                  start: float) -> IterationPlan:
        """The fastest plan of the candidates whose simulated time is `within`, each deferred (`finalize`; of equals
        the fastest before deferral): one whose busiest stage's work alone (`sim.work_bound`, which deferral only
        reorders) is above the fastest so far is not deferred, as it cannot win."""
        best: IterationPlan | None = None
        for cand, _ in (x for x in sorted(kept, key=lambda x: x[1]) if x[1] <= within):
            if best is not None and work_bound(assemble(step, lengths, cand.deployment, cand.micro_batches,
                                                        self._table(cand.deployment, lengths)),
                                               self.cost) > best.predicted_time_s * (1 + 1e-9):
                continue
            plan = self._finish(step, lengths, cand, start)
            best = plan if best is None or plan.predicted_time_s < best.predicted_time_s else best
        assert best is not None  # the fastest candidate is always within
        return best

    def holds(self, deployment: Deployment, longest: int) -> bool:
        """Whether some replica of `deployment` fits a sequence of `longest` tokens."""
        return int(self._table(deployment).lone_cap.max()) >= longest

    def _table(self, deployment: Deployment, lengths: np.ndarray | None = None) -> ReplicaTable:
        """The replica table of a pool deployment (`_tables_for`), or a new one for another."""
        if deployment in self.pool:
            return self._tables_for(lengths)[self.pool.index(deployment)]
        return ReplicaTable.of(self.cost, deployment, self.num_gpus, COUNT_HORIZON if lengths is None else len(lengths))

    def _tables_for(self, lengths: np.ndarray | None = None) -> list[ReplicaTable]:
        """The pool's replica tables for a batch of `lengths` (None: any): a batch of n sequences packs at most n
        micro-batches on a replica, so its decisions read the least cap of counts 2..n (`ReplicaCost.horizon`), not
        of every count; built once per horizon (`count_horizon`) of the pool's interleaved configs."""
        most = COUNT_HORIZON if lengths is None else len(lengths)
        key = tuple(count_horizon(g, most) for g in self._interleaved)
        if key not in self._by_horizon:
            self._by_horizon[key] = [ReplicaTable.of(self.cost, d, self.num_gpus, most) for d in self.pool]
        return self._by_horizon[key]

    def plan_on(self, lengths: Sequence[int] | np.ndarray, deployment: Deployment, step: int = 0) -> IterationPlan:
        """Plan a batch on one given deployment (for proposal and tests)."""
        plan = self.plan_within(lengths, deployment, step)
        assert plan is not None  # with no beat every candidate is kept
        return plan

    def plan_within(self, lengths: Sequence[int] | np.ndarray, deployment: Deployment, step: int = 0,
                    beat: float = np.inf) -> IterationPlan | None:
        """`plan_on`, or None where its slowest replica surely takes `beat` or more (`_pack_and_refine`)."""
        start = time.perf_counter()
        lengths = check_lengths(lengths)
        table = self._table(deployment, lengths)
        if int(table.lone_cap.max()) < int(lengths.max()):
            raise HydraulisError(f"{deployment} cannot hold a sequence of {int(lengths.max())} tokens")
        if deployment in self.pool and self._memo is not None:
            # a pool deployment's candidate is `_packed`'s (the same greedy, search and packing): once per memo
            # (the phased planner merges phases into a part its screen already packed)
            k = self.pool.index(deployment)
            cand = (self._packed(lengths, k, self._greedy(lengths, k), beat) or (None,))[0]
        else:
            cand = self._pack_and_refine(lengths, table, dispatch(lengths, table), deployment, beat)
        if cand is None:
            return None
        if self.method == "milp":
            cand = self._exact(lengths, cand)
        return self._finish(step, lengths, cand, start)

    def schedule(self, lengths: np.ndarray, step: int = 0) -> Schedule:
        plan = self.plan(lengths, step)
        self.remember(step)
        return Schedule.single(plan)

    def remember(self, step: int) -> None:
        """Keep the last whole-batch plan's view of the pool as this step's outlook (a pool of more than one)."""
        if len(self.pool) > 1:
            self.outlook[step] = self._last_outlook

    def caps(self) -> tuple[int, ...]:
        """The longest sequence each pool deployment holds (a replica's lone micro-batch, within the memory)."""
        return tuple(int(t.lone_cap.max()) for t in self._tables_for())

    # -- internals -----------------------------------------------------------------
    def _greedy(self, lengths: np.ndarray, k: int) -> Dispatch:
        """The greedy dispatch of `lengths` on pool deployment k (NoRoom where it has none), once per memo."""
        key = (self.pool[k], lengths.tobytes())
        found = self._memo.get(key) if self._memo is not None else None
        if found is None:
            try:
                found = dispatch(lengths, self._tables_for(lengths)[k], search=False)
            except NoRoom as exc:
                found = exc
            if self._memo is not None:
                self._memo[key] = found
        if isinstance(found, NoRoom):
            raise found
        return found

    def _packed(self, lengths: np.ndarray, k: int, d: Dispatch, beat: float = np.inf) -> tuple[Candidate, float] | None:
        """Deployment k's searched, packed candidate from its greedy dispatch `d`, and its simulated iteration:
        the whole iteration decides, as the simulator runs it (replicas sharing CPU cores slow each other,
        and deployments differ in their optimizer step). None, not kept, where its slowest replica surely takes
        `beat` or more (`_pack_and_refine`); the memo keeps that `beat`."""
        key = ("packed", self.pool[k], lengths.tobytes())
        kept = self._memo.get(key) if self._memo is not None else None
        if isinstance(kept, tuple) or (kept is not None and beat <= kept):  # given up at `kept`: as slow as that
            return kept if isinstance(kept, tuple) else None
        cand = self._pack_and_refine(lengths, k, improve(lengths, self._tables_for(lengths)[k], d), beat=beat)
        if cand is None:  # the memo keeps the beat it gave up at: at or below it, a later call gives up at once
            if self._memo is not None:
                self._memo[key] = beat
            return None
        if self.cost.shared_cores is None:  # each replica's time is its packing's simulation: the slowest, the step
            found = cand, cand.compute_s + self.cost.step_time(cand.deployment.configs)
        else:
            plan = assemble(0, lengths, cand.deployment, cand.micro_batches, self._tables_for(lengths)[k])
            found = cand, simulate(plan, self.cost, keep_events=False).iteration_time_s
        if self._memo is not None:
            self._memo[key] = found
        return found

    def _bound(self, lengths: np.ndarray, k: int) -> float:
        """A lower bound on any simulated iteration of `lengths` on pool deployment k (0 on shared CPU cores,
        where a waiting stage lends its core and the profile's times are no floor)."""
        if self.cost.shared_cores is not None:
            return 0.0
        return self._tables_for(lengths)[k].compute_bound(lengths) + self.cost.step_time(self.pool[k].configs)

    def _worth_packing(self, screened: list[tuple[Dispatch, int]], n: int) -> list[tuple[Dispatch, int]]:
        """The best screened deployments. In a large batch of light sequences the estimate is close to the
        packed time, so only those within LARGE_BATCH_MARGIN of the best estimate are packed.

        On shared CPU cores (`cost.shared_cores`) every one is: the estimate prices each replica as if it had
        its ranks' cores to itself, where the simulator lets a waiting pipeline stage lend its core, and it
        ranks deployments apart by up to 1.5x there (peers.py's bounded pool: 2x(tp2,pp1) estimated best,
        simulated 1.55x the best; 2x(tp1,pp2) estimated 1.29x, simulated best). Such pools are small."""
        if self.cost.shared_cores is not None:
            return screened
        top = screened[: self.full_candidates]
        if n < BULK_MIN_SEQUENCES:
            return top
        bound = top[0][0].makespan_s * (1 + LARGE_BATCH_MARGIN)
        return [x for x in top if x[0].makespan_s <= bound]

    def _pack(
        self, lengths: np.ndarray, table: ReplicaTable, d: Dispatch, packed: dict[tuple, Packing] | None = None,
        beat: float = np.inf, first: np.ndarray | None = None,
    ) -> list[Packing] | None:
        """Each replica's packing; `packed` keeps them by config and members, for the refinement rounds, which
        leave some replicas' sequences as they were (packing is deterministic). None as soon as a replica's
        packing takes `beat` or more (its search gives up beyond it): the replicas in the order `first`."""
        members = d.all_members()
        bulk = len(lengths) >= BULK_MIN_SEQUENCES
        packed = {} if packed is None else packed
        out: list[Packing] = [Packing((), 0.0)] * len(table.replicas)
        for r in range(len(table.replicas)) if first is None else first.tolist():
            replica = table.replicas[r]
            key = (replica.config, members[r].tobytes())
            found = packed[key] if key in packed else pack_replica(indices=members[r], lengths=lengths,
                                                                   replica=replica, cost=self.cost, bulk=bulk,
                                                                   beat=beat)
            if found.time_s >= beat:
                return None
            out[r] = packed[key] = found
        return out

    def _pack_and_refine(self, lengths: np.ndarray, which: int | ReplicaTable, d: Dispatch,
                         deployment: Deployment | None = None, beat: float = np.inf) -> Candidate | None:
        """The packed candidate; None where its slowest replica surely takes `beat` or more: a packing no round or
        MILP follows (either may make the slowest faster) gives up at the first such replica, the likeliest first
        (on shared CPU cores a replica's own time is no floor of the iteration: no beat)."""
        table = self._tables_for(lengths)[which] if isinstance(which, int) else which
        deployment = self.pool[which] if isinstance(which, int) else deployment
        assert deployment is not None
        packed: dict[tuple, Packing] = {}
        # Light sequences in bulk: the estimate is within a fraction of a percent, feedback adds nothing (pp 1: exact).
        rounds = self.refine_rounds if len(lengths) < BULK_MIN_SEQUENCES and (table.pp > 1).any() else 0
        beat = beat if self.method == "heuristic" and self.cost.shared_cores is None else np.inf
        packs = self._pack(lengths, table, d, packed, beat=beat if rounds == 0 else np.inf,
                           first=np.argsort(-d.estimate_s, kind="stable"))
        if packs is None:
            return None
        times = np.array([p.time_s for p in packs])
        bias = np.zeros(len(table))
        for r in range(rounds):
            # What packing and 1F1B add to (or save on) each replica's estimate.
            bias = bias + (times - d.estimate_s)
            try:
                d2 = dispatch(lengths, table, bias)
            except NoRoom:  # the bias moved a long sequence where its lone micro-batch leaves no room
                break
            # The round counts only if every replica comes out faster than the slowest before: the likeliest
            # to miss (by its estimate, bias included) packed first, and none more once one misses.
            # The last round gives up at `beat` too where the packing before took that long: neither comes below.
            last = beat if r == rounds - 1 and times.max() >= beat else np.inf
            packs2 = self._pack(lengths, table, d2, packed, beat=min(float(times.max()) - 1e-12, last),
                                first=np.argsort(-d2.estimate_s, kind="stable"))
            if packs2 is None:
                if last < np.inf:
                    return None
                break
            d, packs, times = d2, packs2, np.array([p.time_s for p in packs2])
        return Candidate(deployment, tuple(p.micro_batches for p in packs), times)

    def _exact(self, lengths: np.ndarray, cand: Candidate) -> Candidate:
        table = self._table(cand.deployment, lengths)
        start = [[mb.tolist() for mb in mbs] for mbs in cand.micro_batches]
        found = exact_assignment(lengths, table, start, self.milp_time_limit_s)
        if found is None:
            return cand
        packs = [
            order_by_simulation([np.array(mb) for mb in mbs], lengths, table.replicas[r], self.cost)
            for r, mbs in enumerate(found[0])
        ]
        times = np.array([p.time_s for p in packs])
        if times.max() >= cand.compute_s:
            return cand
        return Candidate(cand.deployment, tuple(p.micro_batches for p in packs), times)

    def _finish(self, step: int, lengths: np.ndarray, cand: Candidate, start: float) -> IterationPlan:
        """The candidate's plan (`finalize`); deferred, once per memo: a batch's phases often plan one part alike
        (two splits' first phase, its merge) and deferring is the dearest of it."""
        key = None
        if self.zero_bubble and self._memo is not None:
            key = ("final", cand.deployment, step, lengths.tobytes(),
                   tuple(tuple(np.asarray(mb).tobytes() for mb in mbs) for mbs in cand.micro_batches))
            if key in self._memo:
                return dataclasses.replace(self._memo[key], planning_time_s=time.perf_counter() - start)
        plan = finalize(step=step, lengths=lengths, deployment=cand.deployment, micro_batches=cand.micro_batches,
                        cost=self.cost, started=start, table=self._table(cand.deployment, lengths),
                        zero_bubble=self.zero_bubble)
        if key is not None:
            self._memo[key] = plan
        return plan


def _relative(chosen: int, n: int, simulated: dict[int, float], screened: dict[int, float]) -> tuple[float, ...]:
    """Each deployment's predicted time over the chosen one's: simulated where both were (for one skipped by its
    lower bound, the bound: at least that slow), else the dispatch estimates (like against like); inf where it
    could not hold the batch."""
    def ratio(k: int) -> float:
        if k in simulated:
            return simulated[k] / simulated[chosen] if simulated[chosen] > 0 else 1.0
        if k in screened:
            return screened[k] / screened[chosen] if screened[chosen] > 0 else 1.0
        return float("inf")

    return tuple(ratio(k) for k in range(n))
