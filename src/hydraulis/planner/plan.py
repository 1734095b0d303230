"""IterationPlan: the planner's output and the runtime's input, and its JSON form.

Format `hydraulis.plan/1` (docs/design.md, section 8). Every sequence index appears
exactly once; a micro-batch never holds more tokens than its replica's cap. An
iteration of several phases (a Schedule) lists them under `phases`, each with the
batch positions it runs.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hydraulis.cost.model import CostModel
from hydraulis.cost.policies import MemoryPolicy
from hydraulis.errors import HydraulisError
from hydraulis.files import Fields, load_json, write_json_atomic
from hydraulis.limits import MAX_GPUS, MAX_LENGTH, MAX_SEQUENCES
from hydraulis.parallel import Deployment, ParallelConfig
from hydraulis.planner.oracles.deferral import slot_errors
from hydraulis.specs import ClusterSpec

PLAN_SCHEMA = "hydraulis.plan/1"


@dataclass(frozen=True)
class ReplicaPlan:
    """Micro-batches of one replica in execution order; each a tuple of sequence indices."""

    micro_batches: tuple[tuple[int, ...], ...]
    # Each micro-batch's memory policy (cost/policies.py's MemoryPolicy); empty: every one runs its config's
    # plain one (full recompute in the cost model's recompute set, else none).
    policies: tuple[int, ...] = ()
    # Per pipeline stage, where its backwards' weight gradients run (planner/oracles/deferral.py: one slot per
    # backward of the stage's order, the place of the event after which its W runs); empty: the fused backward.
    deferral: tuple[tuple[int, ...], ...] = ()


@dataclass(frozen=True)
class IterationPlan:
    step: int
    lengths: tuple[int, ...]
    deployment: Deployment
    replicas: tuple[ReplicaPlan, ...]
    predicted_time_s: float
    planning_time_s: float = 0.0
    # Each replica's predicted seconds, the simulator's for the planner's cost model (planner.finalize); empty
    # for a plan nobody simulated. They travel with the plan, so no rank simulates it again.
    replica_predicted_s: tuple[float, ...] = ()

    @property
    def num_tokens(self) -> int:
        return int(sum(self.lengths))

    @functools.cached_property
    def lengths_array(self) -> np.ndarray:
        """The lengths as an array, converted once (simulating a large plan asks per replica)."""
        return np.asarray(self.lengths, dtype=np.int64)

    def policy(self, replica: int, micro_batch: int) -> MemoryPolicy | None:
        """The memory policy of a replica's micro-batch; None: its config's plain one."""
        policies = self.replicas[replica].policies
        return MemoryPolicy(policies[micro_batch]) if policies else None

    def micro_batch_lengths(self, replica: int) -> list[np.ndarray]:
        lengths = self.lengths_array
        return [lengths[list(mb)] for mb in self.replicas[replica].micro_batches]

    def validate(self, cost: CostModel | None = None, num_gpus: int | None = None, where: str = "plan") -> None:
        """Every sequence exactly once, in range; caps hold if a cost model is given (a replica's lone
        micro-batch: its lone cap). O(sequences), vectorised."""
        n = len(self.lengths)
        if len(self.replicas) != len(self.deployment.replicas):
            raise HydraulisError(
                f"{where}: {len(self.replicas)} replica plans for {len(self.deployment.replicas)} replicas"
            )
        lengths = self.lengths_array
        seen = np.zeros(n, dtype=np.int64)
        caps: dict[tuple[ParallelConfig, int, int | None], int] = {}
        for r, replica in enumerate(self.replicas):
            mbs = replica.micro_batches
            if not mbs:
                continue
            config = self.deployment.replicas[r].config
            sizes = np.fromiter((len(mb) for mb in mbs), dtype=np.int64, count=len(mbs))
            if (sizes == 0).any():
                raise HydraulisError(f"{where}: replica {r} micro-batch {int(np.argmin(sizes))} is empty")
            ends = np.cumsum(sizes)
            try:
                flat = np.fromiter(itertools.chain.from_iterable(mbs), dtype=np.int64, count=int(ends[-1]))
            except OverflowError:  # an index beyond int64
                flat = np.array([i if 0 <= i < n else -1 for mb in mbs for i in mb], dtype=np.int64)
            bad = (flat < 0) | (flat >= n)
            if bad.any():
                k = int(np.argmax(bad))
                m = int(np.searchsorted(ends, k, side="right"))
                i = mbs[m][k - (int(ends[m - 1]) if m else 0)]
                raise HydraulisError(f"{where}: replica {r} micro-batch {m} has index {i}, outside 0..{n - 1}")
            seen += np.bincount(flat, minlength=n)
            if replica.policies and len(replica.policies) != len(mbs):
                raise HydraulisError(f"{where}: replica {r} has {len(replica.policies)} memory policies for "
                                     f"{len(mbs)} micro-batches")
            if replica.deferral:
                bad = slot_errors(replica.deferral, config.pp, config.vp, len(mbs))
                if bad:
                    raise HydraulisError(f"{where}: replica {r} ({config.name}) deferral: {bad}")
            if cost is not None:
                cap = np.empty(len(mbs), dtype=np.int64)
                for m in range(len(mbs)):  # a lone micro-batch has the lone cap (CostModel.lone_cap)
                    key = (config, len(mbs), self.policy(r, m))
                    if key not in caps:
                        caps[key] = cost.micro_batch_cap(config, num_gpus or self.deployment.num_gpus, len(mbs),
                                                         cost.policy_run(config, key[2]))
                    cap[m] = caps[key]
                tokens = np.add.reduceat(lengths[flat], ends - sizes)
                if (tokens > cap).any():
                    m = int(np.argmax(tokens > cap))
                    raise HydraulisError(
                        f"{where}: replica {r} ({config.name}) micro-batch {m} holds {int(tokens[m])} tokens, "
                        f"over its cap of {int(cap[m])}"
                    )
        missing = np.flatnonzero(seen == 0)
        twice = np.flatnonzero(seen > 1)
        if len(missing):
            raise HydraulisError(f"{where}: sequence {int(missing[0])} is not assigned ({len(missing)} missing)")
        if len(twice):
            raise HydraulisError(f"{where}: sequence {int(twice[0])} is assigned more than once")

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "lengths": [int(s) for s in self.lengths],
            "deployment": self.deployment.to_rows(),
            "replicas": [{"micro_batches": [list(mb) for mb in r.micro_batches],
                          **({"policies": [MemoryPolicy(p).label for p in r.policies]} if r.policies else {}),
                          **({"deferral": [list(x) for x in r.deferral]} if r.deferral else {})}
                         for r in self.replicas],
            "predicted_time_s": self.predicted_time_s,
            "planning_time_s": self.planning_time_s,
            "replica_predicted_s": list(self.replica_predicted_s),
        }

    @classmethod
    def from_dict(cls, data: Any, cluster: ClusterSpec, where: str) -> IterationPlan:
        f = Fields(data, where)
        lengths = f.int_list("lengths", minimum=1, maximum=MAX_LENGTH)
        if len(lengths) > MAX_SEQUENCES:
            raise HydraulisError(f"{where}.lengths: {len(lengths)} sequences, more than the {MAX_SEQUENCES} allowed")
        deployment = Deployment.from_rows(f.list("deployment"), cluster, f"{where}.deployment")
        replicas = []
        for i, row in enumerate(f.list("replicas")):
            r = Fields(row, f"{where}.replicas[{i}]")
            mbs = []
            for j, mb in enumerate(r.list("micro_batches")):
                if not isinstance(mb, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in mb):
                    raise HydraulisError(f"{where}.replicas[{i}].micro_batches[{j}]: expected a list of integers")
                mbs.append(tuple(mb))
            names = r.list("policies", default=[])
            policies = tuple(int(MemoryPolicy.parse(str(p), f"{where}.replicas[{i}].policies")) for p in names)
            stages = r.list("deferral", default=[])
            deferral = tuple(tuple(Fields({"stage": x}, f"{where}.replicas[{i}].deferral").int_list("stage", 0))
                             for x in stages)
            replicas.append(ReplicaPlan(tuple(mbs), policies, deferral))
        plan = cls(
            step=f.int("step", default=0, minimum=0),
            lengths=tuple(lengths),
            deployment=deployment,
            replicas=tuple(replicas),
            predicted_time_s=f.float("predicted_time_s", default=0.0, minimum=0),
            planning_time_s=f.float("planning_time_s", default=0.0, minimum=0),
            replica_predicted_s=tuple(f.float_list("replica_predicted_s", default=[], minimum=0)),
        )
        if plan.replica_predicted_s and len(plan.replica_predicted_s) != len(plan.replicas):
            raise HydraulisError(f"{where}.replica_predicted_s: {len(plan.replica_predicted_s)} times for "
                                 f"{len(plan.replicas)} replicas")
        plan.validate(where=where)
        return plan


@dataclass(frozen=True)
class Schedule:
    """One iteration as a policy runs it: phases in execution order, `indices[k]` mapping phase k's sequences
    to the batch. Most iterations have one phase; with several (phases.py, hotspa), each phase is its own
    deployment on its own part of the batch, gradients accumulate over the phases and the optimizer steps once.
    """

    step: int
    lengths: tuple[int, ...]
    phases: tuple[IterationPlan, ...]
    indices: tuple[tuple[int, ...], ...]
    switch_s: float  # paid once between consecutive phases
    iteration_time_s: float
    planning_time_s: float

    @property
    def num_tokens(self) -> int:
        return int(sum(self.lengths))

    @classmethod
    def single(cls, plan: IterationPlan) -> Schedule:
        return cls(step=plan.step, lengths=plan.lengths, phases=(plan,), indices=(tuple(range(len(plan.lengths))),),
                   switch_s=0.0, iteration_time_s=plan.predicted_time_s, planning_time_s=plan.planning_time_s)

    def to_dict(self) -> dict[str, Any]:
        """One phase: the plan's own JSON (as before phases existed); several: `phases`, each with `indices`."""
        if len(self.phases) == 1:
            return self.phases[0].to_dict()
        phases = []
        for plan, idx in zip(self.phases, self.indices, strict=True):
            row = {k: v for k, v in plan.to_dict().items() if k not in ("step", "lengths")}
            phases.append({"indices": list(idx), **row})
        return {
            "step": self.step,
            "lengths": list(self.lengths),
            "phases": phases,
            "switch_s": self.switch_s,
            "predicted_time_s": self.iteration_time_s,
            "planning_time_s": self.planning_time_s,
        }

    @classmethod
    def from_dict(cls, data: Any, cluster: ClusterSpec, where: str) -> Schedule:
        f = Fields(data, where)
        if not isinstance(data, dict) or "phases" not in data:
            return cls.single(IterationPlan.from_dict(data, cluster, where))
        step = f.int("step", default=0, minimum=0)
        lengths = f.int_list("lengths", minimum=1, maximum=MAX_LENGTH)
        if len(lengths) > MAX_SEQUENCES:
            raise HydraulisError(f"{where}.lengths: {len(lengths)} sequences, more than the {MAX_SEQUENCES} allowed")
        plans, indices = [], []
        for k, row in enumerate(f.list("phases")):
            at = f"{where}.phases[{k}]"
            idx = Fields(row, at).int_list("indices", minimum=0, maximum=len(lengths) - 1)
            plans.append(IterationPlan.from_dict({**row, "step": step, "lengths": [lengths[i] for i in idx]},
                                                 cluster, at))
            indices.append(tuple(idx))
        schedule = cls(step=step, lengths=tuple(lengths), phases=tuple(plans), indices=tuple(indices),
                       switch_s=f.float("switch_s", default=0.0, minimum=0),
                       iteration_time_s=f.float("predicted_time_s", default=0.0, minimum=0),
                       planning_time_s=f.float("planning_time_s", default=0.0, minimum=0))
        covered = sorted(i for idx in indices for i in idx)
        if covered != list(range(len(lengths))):
            raise HydraulisError(f"{where}: the phases' indices do not cover every sequence of the batch exactly once")
        return schedule


@dataclass(frozen=True)
class PlanFile:
    profile: str
    num_gpus: int
    iterations: tuple[Schedule, ...]
    gpus_per_node: int = 8

    @property
    def cluster(self) -> ClusterSpec:
        return ClusterSpec(self.num_gpus, self.gpus_per_node)

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": PLAN_SCHEMA,
            "profile": self.profile,
            "num_gpus": self.num_gpus,
            "gpus_per_node": self.gpus_per_node,
            "iterations": [it.to_dict() for it in self.iterations],
        }


def save_plan(path: str | Path, plan: PlanFile) -> None:
    write_json_atomic(path, plan.to_dict())


def load_plan(path: str | Path) -> PlanFile:
    data = load_json(path, PLAN_SCHEMA)
    f = Fields(data, str(path))
    cluster = ClusterSpec(
        f.int("num_gpus", minimum=1, maximum=MAX_GPUS), f.int("gpus_per_node", default=8, minimum=1, maximum=MAX_GPUS)
    )
    iterations = tuple(
        Schedule.from_dict(it, cluster, f"{path}: iterations[{i}]") for i, it in enumerate(f.list("iterations"))
    )
    if not iterations:
        raise HydraulisError(f"{path}: no iterations")
    return PlanFile(f.str("profile"), cluster.num_gpus, iterations, cluster.gpus_per_node)


def plan_from_assignment(
    step: int,
    lengths: Sequence[int],
    deployment: Deployment,
    micro_batches: Sequence[Sequence[Sequence[int]]],
    predicted_time_s: float,
    planning_time_s: float = 0.0,
    policies: Sequence[Sequence[int]] | None = None,
) -> IterationPlan:
    """`policies`: per replica, each micro-batch's memory policy, or empty (the config's plain one)."""
    policies = policies if policies is not None else [()] * len(micro_batches)
    return IterationPlan(
        step=step,
        lengths=tuple(_ints(lengths)),
        deployment=deployment,
        replicas=tuple(ReplicaPlan(tuple(tuple(_ints(mb)) for mb in mbs), tuple(int(p) for p in ps))
                       for mbs, ps in zip(micro_batches, policies, strict=True)),
        predicted_time_s=float(predicted_time_s),
        planning_time_s=float(planning_time_s),
    )


# -- the wire format of a plan ------------------------------------------------------------------------
def encode_plan(plan: IterationPlan, pool_index: int) -> np.ndarray:
    """The plan's wire format: rank 0 broadcasts it as one int64 vector over a CPU group (runtime/trainer.py).

    [pool index, replicas, micro-batches per replica..., sizes..., memory policies (-1: the plain one)...,
    sequence indices..., the deferral's length and the deferral (per replica its stages listed, 0 where fused,
    then per stage its slots' count and its slots), float64s as bits: the predicted and planning times, then each
    replica's predicted time when the plan has them].
    """
    mbs = [mb for r in plan.replicas for mb in r.micro_batches]
    policies = [p for r in plan.replicas for p in (r.policies or [-1] * len(r.micro_batches))]
    head = [pool_index, len(plan.replicas), *(len(r.micro_batches) for r in plan.replicas), *(len(m) for m in mbs),
            *policies]
    deferral = [x for r in plan.replicas for x in (len(r.deferral), *(y for s in r.deferral for y in (len(s), *s)))]
    times = [plan.predicted_time_s, plan.planning_time_s, *plan.replica_predicted_s]
    floats = np.array(times, dtype=np.float64).view(np.int64)
    return np.concatenate([np.array(head, np.int64), np.array([i for m in mbs for i in m], np.int64),
                           np.array([len(deferral), *deferral], np.int64), floats])


def decode_plan(data: np.ndarray, step: int, lengths: Sequence[int], pool: Sequence[Deployment]) -> IterationPlan:
    """The plan `encode_plan` wrote, given what every rank knows already: the step, the batch and the pool."""
    index, replicas = int(data[0]), int(data[1])
    counts = data[2 : 2 + replicas]
    pos = 2 + replicas
    sizes = data[pos : pos + int(counts.sum())]
    pos += len(sizes)
    policies = data[pos : pos + len(sizes)]
    pos += len(sizes)
    flat = data[pos : pos + int(sizes.sum())]
    pos += len(flat)
    deferral = _deferral(data[pos + 1 : pos + 1 + int(data[pos])].tolist(), replicas)
    predicted, planning, *per_replica_s = data[pos + 1 + int(data[pos]) :].view(np.float64).tolist()
    cuts = np.cumsum(sizes)[:-1]
    mbs = np.split(flat, cuts) if len(sizes) else []
    per_replica, per_policies, k = [], [], 0
    for c in counts:
        per_replica.append(mbs[k : k + int(c)])
        own = policies[k : k + int(c)].tolist()
        per_policies.append(() if all(p < 0 for p in own) else own)
        k += int(c)
    plan = plan_from_assignment(step=step, lengths=lengths, deployment=pool[index], micro_batches=per_replica,
                                predicted_time_s=predicted, planning_time_s=planning, policies=per_policies)
    if any(deferral):
        plan = dataclasses.replace(plan, replicas=tuple(dataclasses.replace(r, deferral=d)
                                                        for r, d in zip(plan.replicas, deferral, strict=True)))
    return dataclasses.replace(plan, replica_predicted_s=tuple(per_replica_s)) if per_replica_s else plan


def _deferral(values: list[int], replicas: int) -> list[tuple[tuple[int, ...], ...]]:
    """`encode_plan`'s deferral block read back: per replica its stages' slots (empty: fused)."""
    out, pos = [], 0
    for _ in range(replicas):
        stages, pos = values[pos], pos + 1
        own = []
        for _ in range(stages):
            own.append(tuple(values[pos + 1 : pos + 1 + values[pos]]))
            pos += 1 + values[pos]
        out.append(tuple(own))
    return out


def encode_schedule(schedule: Schedule, pool: Sequence[Deployment]) -> np.ndarray:
    """A schedule's wire format: one phase is exactly `encode_plan`'s vector (its first value, the pool
    index, is never negative); several are [-phases, then per phase: its vector's length, its batch
    positions' count, the positions, its `encode_plan` vector; then 3 float64s as bits]."""
    if len(schedule.phases) == 1:
        return encode_plan(schedule.phases[0], pool.index(schedule.phases[0].deployment))
    parts: list[np.ndarray] = [np.array([-len(schedule.phases)], np.int64)]
    for plan, idx in zip(schedule.phases, schedule.indices, strict=True):
        vector = encode_plan(plan, pool.index(plan.deployment))
        parts += [np.array([len(vector), len(idx), *idx], np.int64), vector]
    floats = [schedule.switch_s, schedule.iteration_time_s, schedule.planning_time_s]
    parts.append(np.array(floats, dtype=np.float64).view(np.int64))
    return np.concatenate(parts)


def decode_schedule(data: np.ndarray, step: int, lengths: Sequence[int], pool: Sequence[Deployment]) -> Schedule:
    """The schedule `encode_schedule` wrote, given the step, the batch and the pool every rank knows."""
    if int(data[0]) >= 0:
        return Schedule.single(decode_plan(data, step, lengths, pool))
    plans, indices, pos = [], [], 1
    for _ in range(-int(data[0])):
        size, count = int(data[pos]), int(data[pos + 1])
        idx = tuple(int(i) for i in data[pos + 2 : pos + 2 + count])
        pos += 2 + count
        plans.append(decode_plan(data[pos : pos + size], step, [lengths[i] for i in idx], pool))
        indices.append(idx)
        pos += size
    switch, total, planning = data[pos : pos + 3].view(np.float64)
    return Schedule(step=step, lengths=tuple(int(x) for x in lengths), phases=tuple(plans), indices=tuple(indices),
                    switch_s=float(switch), iteration_time_s=float(total), planning_time_s=float(planning))


def _ints(values: Sequence[int] | np.ndarray) -> list[int]:
    """Python ints (numpy's tolist is one C call; a generator of int() is one Python call per value)."""
    if isinstance(values, np.ndarray):
        if not np.issubdtype(values.dtype, np.integer):
            raise HydraulisError("sequence lengths and indices must be integers")
        return values.tolist()
    return [int(v) for v in values]
