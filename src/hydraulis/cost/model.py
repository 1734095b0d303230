"""The cost model interface: time of a micro-batch, memory cap, busy threshold.

Time of one packed micro-batch (lengths s_i) on one pipeline stage of config g,
forward plus backward (docs/design.md, section 4):

    t_g(mb) = a_g * sum(s_i^2) + b_g * sum(s_i) + c_g

Subclasses only supply the coefficients per config and the memory constants;
everything else, vectorised, lives here so that every consumer (planner,
simulator, baselines, proposal) costs things the same way.

The memory model and the training state it counts are memory.py; the CP
terms and the analytic extension to cp > 1 (`extend_to_cp`) are
context_parallel.py.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from hydraulis.cost.activations import COUNT_HORIZON, count_horizon, counted
from hydraulis.cost.conditions import SharedCores
from hydraulis.cost.memory import CAP_GRANULARITY, MemoryModel
from hydraulis.cost.policies import LIGHTEST_FIRST, RECOMPUTE_TIME, MemoryPolicy, derived_scales
from hydraulis.cost.shards import TrainingState
from hydraulis.errors import HydraulisError
from hydraulis.parallel import ParallelConfig
from hydraulis.specs import DeviceSpec, ModelSpec

__all__ = ["CAP_GRANULARITY", "Coefficients", "CostModel", "MemoryModel", "TrainingState", "sequence_costs"]

FORWARD_SHARE = 1 / 3  # a forward of a training step's three forwards' worth (backward: two)


def sequence_costs(a: float | np.ndarray, b: float | np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """a*s^2 + b*s: what each sequence adds to a micro-batch's stage time (c is per micro-batch).

    `a` and `b` broadcast against the lengths: scalars for one config, [configs, 1] columns for a matrix.
    """
    s = np.asarray(lengths, dtype=np.float64)
    return a * s * s + b * s


@dataclass(frozen=True)
class Coefficients:
    """Seconds: a per squared token, b per token, c per micro-batch (one stage, fwd+bwd)."""

    a: float
    b: float
    c: float


@dataclass(frozen=True)
class Link:
    """A measured link: t = latency_s + bytes / bandwidth_Bps."""

    latency_s: float
    bandwidth_Bps: float

    def time(self, num_bytes: float) -> float:
        return self.latency_s + num_bytes / self.bandwidth_Bps


@dataclass(frozen=True)
class Collectives:
    """Links measured by `hydraulis profile` on one node of `world_size` ranks; None where not measured.

    all_to_all: the optimizer's gather and reduce (`all_to_all_single` with
    split sizes), bytes = what one rank sends to the others; p2p: one
    pipeline activation transfer between neighbouring ranks.
    """

    world_size: int
    all_to_all: Link | None = None
    p2p: Link | None = None


@dataclass(frozen=True)
class OptimizerStep:
    """The trainer's phase after compute (gather, gradient reduce, norm, AdamW), measured per config.

    Seconds on a deployment of each config filling a job of `world_size`
    ranks; a deployment costs its slowest config's (the exchange waits for it).
    """

    world_size: int
    seconds: dict[ParallelConfig, float]
    gather: dict[ParallelConfig, float] = field(default_factory=dict)  # its gather alone, where measured
    reduce: dict[ParallelConfig, float] = field(default_factory=dict)  # its reduce alone, where measured


class CostModel:
    """Coefficients per config, a memory model, and the vectorised costing built on them."""

    def __init__(
        self,
        name: str,
        model: ModelSpec,
        device: DeviceSpec,
        coefficients: dict[ParallelConfig, Coefficients],
        memory: MemoryModel,
        min_efficient_tokens: dict[int, int],
        collectives: Collectives | None = None,
        shared_cores: SharedCores | None = None,
        optimizer_step: OptimizerStep | None = None,
    ) -> None:
        if not coefficients:
            raise HydraulisError(f"cost model {name!r} has no parallel configs")
        self.name = name
        self.model = model
        self.device = device
        self.memory = memory
        self.collectives = collectives  # measured links replace the device constants within a node
        self.shared_cores = shared_cores  # CPU profiles: the simulator rescales times by the ranks busy at once
        self.optimizer_step = optimizer_step  # measured step after compute; else grad_sync_time's estimate
        self.profile_data: dict | None = None  # the profile file's data (its conditions; a refit writes it back)
        self.overlap_exchange = False  # the trainer's exchange runs inside compute (exchange_in_compute)
        self._min_efficient = dict(min_efficient_tokens)
        self._set_coefficients(coefficients)
        self.recompute: frozenset[ParallelConfig] = frozenset()
        self.selective: frozenset[ParallelConfig] = frozenset()  # run selective always (`with_uniform`; the bench)
        # Per-micro-batch memory policies (policies.py): off, every micro-batch runs its config's one policy.
        self.memory_policies = False
        self.policy_scales: dict[ParallelConfig, dict[MemoryPolicy, tuple[float, float]]] = {}  # measured

    def _set_coefficients(self, coefficients: dict[ParallelConfig, Coefficients]) -> None:
        self.configs: tuple[ParallelConfig, ...] = tuple(
            sorted(coefficients, key=lambda c: (c.num_gpus, c.tp, c.pp, c.cp))
        )
        self._index = {c: i for i, c in enumerate(self.configs)}
        self.a = np.array([coefficients[c].a for c in self.configs])
        self.b = np.array([coefficients[c].b for c in self.configs])
        self.c = np.array([coefficients[c].c for c in self.configs])

    def with_configs(
        self, name: str, coefficients: dict[ParallelConfig, Coefficients], recompute: Iterable[ParallelConfig]
    ) -> CostModel:
        """A copy under another name with this coefficient table and recompute set; the rest is shared."""
        out = copy.copy(self)
        out.name = name
        out._set_coefficients(coefficients)
        out.recompute = frozenset(recompute)
        return out

    def with_interleaving(self) -> CostModel:
        """A copy whose configs also run interleaved 1F1B, each at hydraulis's vp, one layer a chunk
        (`ParallelConfig.planned_vp_choices`; the same coefficients: the same layers per stage; their caps count the
        warm-up's chunks, the simulator each chunk's send), so that proposal and planner weigh them beside plain
        1F1B. Named apart: its plans hold configs the plain model's do not."""
        out = copy.copy(self)
        extra = [g.interleaved(v) for g in self.configs for v in g.planned_vp_choices(self.model)]
        out.configs = tuple(sorted((*self.configs, *extra), key=lambda c: (c.num_gpus, c.tp, c.pp, c.cp, c.vp)))
        out.name = f"{self.name}+vp"
        return out

    def with_overlap(self, overlap: bool) -> CostModel:
        """A copy whose replica times hold the exchange inside compute when `overlap` (the trainer's setting)."""
        out = copy.copy(self)
        out.overlap_exchange = overlap
        return out

    def with_recompute(self, configs: Iterable[ParallelConfig]) -> CostModel:
        """A copy in which these configs recompute activations: a larger cap, a and b x RECOMPUTE_TIME.

        The runtime checkpoints every transformer block of exactly these configs' replicas, so
        the planner's caps and times describe what runs.
        """
        new = frozenset(g.base for g in configs) - self.recompute
        out = copy.copy(self)
        idx = [self.index(g) for g in new]
        out.a = self.a.copy()
        out.b = self.b.copy()
        out.a[idx] *= RECOMPUTE_TIME
        out.b[idx] *= RECOMPUTE_TIME
        out.recompute = self.recompute | new
        return out

    def with_uniform(self, configs: Iterable[ParallelConfig], policy: MemoryPolicy) -> CostModel:
        """A copy in which every micro-batch of these configs runs `policy` (a run-wide setting, as a Megatron
        user switches on recompute): full is `with_recompute`; selective scales a and b by its factors and makes
        its caps the configs' plain ones. The simulator's only: the runtime checkpoints the recompute set."""
        if policy == MemoryPolicy.FULL:
            return self.with_recompute(configs)
        new = frozenset(g.base for g in configs) - self.recompute - self.selective
        if policy == MemoryPolicy.NONE or not new:
            return self
        out = copy.copy(self)
        out.a = self.a.copy()
        out.b = self.b.copy()
        for g in new:
            sa, sb = self.policy_scale(g, policy)
            out.a[self.index(g)] *= sa
            out.b[self.index(g)] *= sb
        out.selective = self.selective | new
        return out

    def with_policies(self, on: bool) -> CostModel:
        """A copy whose planner may choose a memory policy per micro-batch (`on`), or not: the lightest whose
        cap holds the micro-batch (planner/replicas.py's `ReplicaCost.policy`). The recompute set keeps full."""
        out = copy.copy(self)
        out.memory_policies = on
        return out

    def recomputes(self, config: ParallelConfig) -> bool:
        """Whether `config` is in the recompute set: its runtime checkpoints every block of every micro-batch (a
        run-wide setting holds for every vp of the config's GPUs: the set holds base configs)."""
        return config.base in self.recompute

    def policy_run(self, config: ParallelConfig, listed: int | None) -> MemoryPolicy:
        """The policy a micro-batch of `config` runs: the one its plan lists, None meaning the plain one; a config of
        the recompute set runs full whatever is listed (the runtime checkpoints its every block: modeling/model.py)."""
        return self.policies(config)[0] if listed is None or self.recomputes(config) else MemoryPolicy(listed)

    def policies(self, config: ParallelConfig) -> tuple[MemoryPolicy, ...]:
        """The memory policies a micro-batch of `config` may run, lightest first; the first is its plain one."""
        base = config.base  # a run-wide setting holds for every vp of the config's GPUs
        if self.recomputes(base):
            return (MemoryPolicy.FULL,)
        if base in self.selective:
            return (MemoryPolicy.SELECTIVE,)
        return LIGHTEST_FIRST if self.memory_policies else (MemoryPolicy.NONE,)

    def policy_scale(self, config: ParallelConfig, policy: MemoryPolicy | None) -> tuple[float, float]:
        """(a, b) factors of a micro-batch under `policy` on `config` (None: its plain one): measured by the
        profile where it timed them, else derived from FLOPs; 1 in the recompute set (already in a, b)."""
        if policy is None:
            return 1.0, 1.0
        base = config.base
        if self.recomputes(base) or base in self.selective:
            return 1.0, 1.0
        measured = self.policy_scales.get(base, {})
        return measured[policy] if policy in measured else derived_scales(self.model)[policy]

    def forward_only(self) -> CostModel:
        """A copy whose micro-batch times are forward only (evaluation): FORWARD_SHARE of a step's a, b and c, of
        the recomputing configs' a and b a quarter (their step ran four forwards). Caps stay the training ones,
        which hold more than a forward needs."""
        out = copy.copy(self)
        share = np.full(len(self.configs), FORWARD_SHARE)
        share[[self.index(g) for g in self.recompute]] = FORWARD_SHARE / RECOMPUTE_TIME
        out.a = self.a * share
        out.b = self.b * share
        out.c = self.c * FORWARD_SHARE
        return out

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, {len(self.configs)} configs)"

    # -- coefficients -------------------------------------------------------
    def index(self, config: ParallelConfig) -> int:
        try:
            return self._index[config.base]  # interleaving changes no coefficient: the same stage's work
        except KeyError:
            known = ", ".join(c.name for c in self.configs)
            raise HydraulisError(f"cost model {self.name!r} has no config {config.name}; it knows {known}") from None

    def coefficients(self, config: ParallelConfig) -> Coefficients:
        i = self.index(config)
        return Coefficients(float(self.a[i]), float(self.b[i]), float(self.c[i]))

    # -- time -----------------------------------------------------------------
    def stage_time(
        self, config: ParallelConfig, lengths: Sequence[int] | np.ndarray, policy: MemoryPolicy | None = None
    ) -> float:
        """Forward+backward seconds of one packed micro-batch on one stage (under `policy`, None its plain one)."""
        i = self.index(config)
        s = np.asarray(lengths, dtype=np.float64)
        sa, sb = self.policy_scale(config, policy)
        return float(sa * self.a[i] * np.dot(s, s) + sb * self.b[i] * s.sum() + self.c[i])

    def seq_costs(self, config: ParallelConfig, lengths: np.ndarray) -> np.ndarray:
        """a*s^2 + b*s per sequence: the part of stage time each sequence adds (no c)."""
        i = self.index(config)
        return sequence_costs(self.a[i], self.b[i], lengths)

    def cost_matrix(self, lengths: np.ndarray, configs: Sequence[ParallelConfig] | None = None) -> np.ndarray:
        """[configs x sequences] of a*s^2 + b*s, in one vectorised expression."""
        idx = np.array([self.index(c) for c in configs]) if configs is not None else np.arange(len(self.configs))
        return sequence_costs(self.a[idx, None], self.b[idx, None], np.asarray(lengths)[None, :])

    # -- memory -----------------------------------------------------------------
    def cap(self, config: ParallelConfig, num_gpus: int, horizon: int = COUNT_HORIZON) -> int:
        """Most tokens each micro-batch may hold on `config` in a job of `num_gpus`, whatever their count (from two
        to `horizon`: `count_horizon`), under its plain memory policy."""
        return self.policy_cap(config, num_gpus, self.policies(config)[0], horizon=horizon)

    def lone_cap(self, config: ParallelConfig, num_gpus: int) -> int:
        """Most tokens of a replica's only micro-batch under any policy it may run, so the longest sequence
        `config` holds: a deep replica keeps a lone micro-batch in flight once, not pp times
        (activations.in_flight)."""
        return max(self.policy_cap(config, num_gpus, p, 1) for p in self.policies(config))

    def policy_cap(
        self, config: ParallelConfig, num_gpus: int, policy: MemoryPolicy, micro_batches: int | None = None,
        horizon: int = COUNT_HORIZON,
    ) -> int:
        """`memory.cap` under a memory policy (for any count, None: every count from two to `horizon`, taken at
        `count_horizon`'s), a search over the memory model that planning asks thousands of times, kept
        (`cap_cache`)."""
        cache = self.cap_cache()
        horizon = count_horizon(config, horizon) if micro_batches is None else COUNT_HORIZON
        key = (config, num_gpus, int(policy), micro_batches, horizon)
        if key not in cache:
            cache[key] = self.memory.cap(config, self.model, num_gpus, policy, micro_batches=micro_batches,
                                         horizon=horizon)
        return cache[key]

    def cap_cache(self) -> dict[tuple, int]:
        """The caps `policy_cap` keeps, per (memory model, model spec): both are frozen, so a copy that replaces either
        starts a fresh cache. The proposal's forked workers hand what they add back (`fan_out`'s memo)."""
        cache = self.__dict__.get("_cap_cache")
        if cache is None or cache[0] is not self.memory or cache[1] is not self.model:
            cache = self._cap_cache = (self.memory, self.model, {})
        return cache[2]

    def micro_batch_cap(
        self, config: ParallelConfig, num_gpus: int, micro_batches: int, policy: MemoryPolicy | None = None
    ) -> int:
        """Most tokens of each of a replica's `micro_batches` micro-batches (under `policy`: its cap; None, the plain
        one, or any policy for a lone one), at that count where it may hold other than the worst count (`counted`:
        interleaved every count, whose chunks in flight follow no period)."""
        if policy is None and micro_batches == 1:
            return self.lone_cap(config, num_gpus)
        policy = self.policies(config)[0] if policy is None else policy
        return self.policy_cap(config, num_gpus, policy, counted(config, micro_batches))

    def for_job(
        self, memory_bytes: int | None, dtype_bytes: int, bucket_bytes: int | None = None,
        sequence_parallel: bool = False,
    ) -> CostModel:
        """A copy whose caps are for this compute dtype, exchange bucket, sequence parallelism and, when given,
        memory budget per rank."""
        out = copy.copy(self)
        out.memory = self.memory.for_job(memory_bytes, dtype_bytes, bucket_bytes, sequence_parallel)
        return out

    def later_phase(self) -> CostModel:
        """A copy for a later phase of a phased iteration, whose ranks hold the earlier phases' reduced gradient
        beside the activations (memory.py's `reduced_held`): smaller caps. One copy while this model stays as it
        was (each attribute the same object), so its caps are found once for every planner, check and meter."""
        kept = self.__dict__.get("_later")
        state = {k: v for k, v in vars(self).items() if k not in ("_cap_cache", "_later")}  # its caches aside
        if kept is None or kept[0].keys() != state.keys() or any(kept[0][k] is not v for k, v in state.items()):
            out = copy.copy(self)
            out.__dict__ = {**state, "memory": replace(self.memory, reduced_held=True)}
            self._later = kept = (state, out)
        return kept[1]

    def caps(self, num_gpus: int) -> dict[ParallelConfig, int]:
        return {c: self.cap(c, num_gpus) for c in self.configs if c.num_gpus <= num_gpus}

    def min_efficient_tokens(self, config: ParallelConfig) -> int:
        """Fewest tokens a micro-batch needs to keep the GPU busy (under CP, each of its cp ranks)."""
        table = self._min_efficient
        if not table:
            return 0
        if config.tp in table:
            return table[config.tp] * config.cp
        keys = sorted(table)
        below = [k for k in keys if k <= config.tp]
        return (table[below[-1]] if below else table[keys[0]]) * config.cp

    # -- communication ---------------------------------------------------------
    def p2p_time(self, config: ParallelConfig, tokens: int) -> float:
        """One stage boundary crossing of a micro-batch's activations (bf16), one way."""
        measured = self.collectives.p2p if self.collectives is not None else None
        share = tokens * self.model.hidden * 2 / (config.tp * config.cp)  # each CP rank sends its share
        if measured is not None and config.num_gpus <= self.device.gpus_per_node:
            return measured.time(share)
        bandwidth = (
            self.device.inter_node_bw if config.num_gpus > self.device.gpus_per_node else self.device.intra_node_bw
        )
        return self.device.p2p_latency_s + share / bandwidth

    def grad_sync_time(self, num_gpus: int) -> float:
        """Reduce gradients into the owner shards and gather parameters back.

        About 2 x parameter bytes (bf16) / N per GPU at the slowest link (docs/design.md, section 4). A
        profile's measured all-to-all link replaces the device constants within a node (one
        gather plus one reduce, each paying its latency); across nodes the constants stay.
        """
        if num_gpus <= 1:
            return 0.0
        measured = self.collectives.all_to_all if self.collectives is not None else None
        if measured is not None and num_gpus <= self.device.gpus_per_node:
            return 2 * measured.time(2 * self.model.num_params / num_gpus)
        bandwidth = self.device.inter_node_bw if num_gpus > self.device.gpus_per_node else self.device.intra_node_bw
        return 2 * (2 * self.model.num_params) / num_gpus / bandwidth

    def _at_world(self, seconds: float, num_gpus: int) -> float | None:
        """A time of the profile's optimizer step at `num_gpus` ranks: as measured at its world size, rescaled by
        the shared cores' load at another (on tiny a rank's share hardly shrinks with more ranks); None on GPUs
        at another world size."""
        step, shared = self.optimizer_step, self.shared_cores
        if step is None or step.world_size == num_gpus:
            return seconds
        return seconds * shared.load(num_gpus) / shared.load(step.world_size) if shared is not None else None

    def exchange_time(
        self, before: Sequence[ParallelConfig] | None, after: Sequence[ParallelConfig] | None, num_gpus: int
    ) -> float:
        """Seconds of a phase change: the reduce of `before`'s gradients into the owners and the gather of
        `after`'s compute shard, each as the profile measured it alone for the slowest config of its deployment
        (the exchange waits for it). Without the deployments (an estimate before they are planned), the slowest
        measured config. Where not measured, the exchange estimate of grad_sync_time."""
        step = self.optimizer_step
        if step is None or not step.reduce or not step.gather:
            return self.grad_sync_time(num_gpus)
        before = tuple(step.reduce) if before is None else tuple(c.base for c in before)
        after = tuple(step.gather) if after is None else tuple(c.base for c in after)
        if not all(c in step.reduce for c in before) or not all(c in step.gather for c in after):
            return self.grad_sync_time(num_gpus)
        seconds = self._at_world(max(step.reduce[c] for c in before) + max(step.gather[c] for c in after), num_gpus)
        return self.grad_sync_time(num_gpus) if seconds is None else seconds

    def exchange_in_compute(self, config: ParallelConfig, num_gpus: int) -> float:
        """Seconds of the optimizer's exchange a replica of `config` spends inside its compute when it
        overlaps (runtime/optimizer/exchange.py): a pp = 1 replica gathers from its layers' hooks and a pipeline before
        its first micro-batch; both send the reduce from backward. Measured, at the profile's world size
        (rescaled as step_time does); 0 where not measured. Part of the step, not added to the iteration:
        it moves time from after compute into each replica's."""
        step, config = self.optimizer_step, config.base
        if step is None or config not in step.reduce:
            return 0.0
        seconds = self._at_world(step.reduce[config] + (step.gather.get(config, 0.0) if config.pp == 1 else 0.0),
                                 num_gpus)
        return 0.0 if seconds is None else seconds

    def step_time(self, configs: Sequence[ParallelConfig]) -> float:
        """Seconds after compute of an iteration on a deployment of these configs: measured where profiled.

        A profile's measured optimizer step (every config measured) counts the
        gather, the reduce, the norm and AdamW as the trainer runs them. At
        another world size on shared CPU cores it is rescaled by the cores'
        load (on tiny, latency-bound, a rank's share of the step hardly shrinks
        with more ranks: 4.6 ms at 2 ranks, 10.6 ms at 4 on 2 cores); otherwise
        the exchange estimate of grad_sync_time.
        """
        num_gpus = sum(c.num_gpus for c in configs)
        step, configs = self.optimizer_step, [c.base for c in configs]
        if step is None or not all(c in step.seconds for c in configs):
            return self.grad_sync_time(num_gpus)
        seconds = self._at_world(max(step.seconds[c] for c in configs), num_gpus)
        return self.grad_sync_time(num_gpus) if seconds is None else seconds
