"""Policies and what they are built from: the Policy protocol and the PolicyContext.

Dependencies run one way: policy -> proposal -> planner -> schedule (the
Schedule type lives in its own module, so the planner never imports this one).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from hydraulis.cost.model import CostModel
from hydraulis.cost.policies import MemoryPolicy
from hydraulis.errors import CrowdedError, OverlongError
from hydraulis.parallel import Deployment, ParallelConfig
from hydraulis.planner.pool import fallback_config, fallback_deployment
from hydraulis.planner.proposal.propose import propose
from hydraulis.planner.schedule import Schedule
from hydraulis.specs import ClusterSpec


class Policy(Protocol):
    """Plans global batches on a fixed cluster with a fixed cost model."""

    name: str
    cost: CostModel  # what its schedules are costed and checked on (megatron-dcp adds its CP group sizes)

    def schedule(self, lengths: np.ndarray, step: int = 0) -> Schedule: ...


@dataclass(frozen=True)
class PolicyContext:
    """What every policy is built from: the same cost model, cluster, pools and run facts.

    Pools are proposed on first use, so policies that need none (the
    homogeneous baselines, hotspa) never pay for a proposal.
    """

    cost: CostModel
    cluster: ClusterSpec
    run_max_length: int  # the longest sequence of the run (homogeneous baselines must hold it)
    sample: tuple[np.ndarray, ...]  # sample batches, for choosing configs and proposing pools
    user_pool: tuple[Deployment, ...] | None = None  # the user's pool: every pool-based policy uses it
    proposed_pool: tuple[Deployment, ...] | None = None  # a pool already proposed from this data
    # The baselines run the recipes' interleaving, and the bench's hydraulis plans on `CostModel.with_interleaving`;
    # off (`hydraulis bench --vp1`), every policy runs plain 1F1B. The bench's only: the trainer weighs vp in its own
    # proposal (`training.job.propose_pool`, `[parallel] interleave`).
    interleave: bool = False
    # The bench's hydraulis defers its weight gradients into the pipelines' gaps where that simulates faster
    # (`Planner(zero_bubble=...)`, planner/oracles/deferral.py); off (`hydraulis bench --fused-backward`), it plans
    # fused backwards as before. The baselines never do.
    zero_bubble: bool = False

    @property
    def num_gpus(self) -> int:
        return self.cluster.num_gpus

    @functools.cached_property
    def pool(self) -> tuple[Deployment, ...]:
        """The planner's deployments (pool[0] the fallback): the user's, or proposed from the sample."""
        if self.user_pool is not None:
            return self.user_pool
        if self.proposed_pool is not None:
            return self.proposed_pool
        return self._propose("hydraulis")

    @functools.cached_property
    def reference_pool(self) -> tuple[Deployment, ...]:
        """The published system's own pool: its range DP, unless the user gave a pool for all."""
        if self.user_pool is not None:
            return self.user_pool
        return self._propose("published")

    def recompute_where_needed(self, lone: bool, lightest: bool = False) -> PolicyContext:
        """This context, or, where no homogeneous deployment holds the run's longest sequence
        (`fallback_config`; `lone` as a policy packs), one whose cost model recomputes activations in the
        configs that hold it only so, for all their micro-batches: full recompute, or with `lightest` the
        lightest uniform memory policy that holds it (selective where it does), what a user of any system
        switches on for a run (the bench gives it to every baseline alike)."""
        try:
            if lone:  # the planner's fallback may mix configs (`fallback_deployment`)
                fallback_deployment(self.cost, self.cluster, self.run_max_length, self.sample)
            else:
                fallback_config(self.cost, self.cluster, self.run_max_length, self.sample, lone=False)
            return self
        except (OverlongError, CrowdedError):
            pass
        N, longest, cost = self.num_gpus, self.run_max_length, self.cost
        policies = (MemoryPolicy.SELECTIVE, MemoryPolicy.FULL) if lightest else (MemoryPolicy.FULL,)

        def holds(g: ParallelConfig, policy: MemoryPolicy) -> bool:
            return cost.policy_cap(g, N, policy, 1 if lone else None) >= longest

        need: dict[MemoryPolicy, list[ParallelConfig]] = {p: [] for p in policies}
        for g in cost.configs:
            if g.num_gpus <= N and not cost.recomputes(g) and not holds(g, cost.policies(g)[0]):
                policy = next((p for p in policies if holds(g, p)), None)
                if policy is not None:
                    need[policy].append(g)
        if not any(need.values()):
            return self
        for policy, configs in need.items():
            cost = cost.with_uniform(configs, policy)
        cost.name = f"{self.cost.name}+{'lightest-' if need.get(MemoryPolicy.SELECTIVE) else ''}recompute"
        return dataclasses.replace(self, cost=cost)

    def _propose(self, method: str) -> tuple[Deployment, ...]:
        return propose(
            self.cost, self.cluster, self.sample, method=method, max_length=self.run_max_length
        ).pool.deployments

    @classmethod
    def build(
        cls,
        cost: CostModel,
        cluster: ClusterSpec,
        batches: Sequence[np.ndarray],
        pool: Sequence[Deployment] | None = None,
        sample: Sequence[np.ndarray] | None = None,
        proposed: Sequence[Deployment] | None = None,
    ) -> PolicyContext:
        """`pool` is the user's; `proposed` one proposed beforehand; `sample` defaults to the batches."""
        sample = tuple(np.asarray(b, dtype=np.int64) for b in (sample if sample is not None else batches))
        longest = max(int(np.max(b)) for b in list(batches) + list(sample))
        return cls(cost=cost, cluster=cluster, run_max_length=longest, sample=sample,
                   user_pool=tuple(pool) if pool is not None else None,
                   proposed_pool=tuple(proposed) if proposed is not None else None)
