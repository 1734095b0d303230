"""hotspa (docs/design.md, section 5): temporal switching between homogeneous configs within an iteration.

The batch, sorted by length, is split into length ranges at config caps; each
range runs as one phase on the whole cluster with the homogeneous config that
runs it fastest (flops-balanced over replicas, token-capped packing), one phase
after another, paying a switch between phases. The split minimises the
estimated total by a dynamic programme over the cap levels; phases are then
planned and simulated.

What a switch moves: HotSPa (Ge et al., SOSP'24) "transfers model parameters
and accumulated gradients among the devices" at every hot switch, and Hetu's
code does both on a switch inside a mini-batch (`DefineAndRunGraph` in
hetu/graph/define_and_run_graph.cc: a parameter switcher in
SWITCH_TRANSFER_PARAM mode, then a gradient switcher in SWITCH_ACCUMULATE_GRAD
mode whenever the old graph has accumulated gradients). So a switch is the
parameters into the next layout plus the accumulated gradients, each about the
bf16 parameter bytes over N per GPU: the same bytes as the planner's phase
change (a reduce into the owners and a gather), `schedule.phase_switch_time`.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from hydraulis.baselines.homogeneous import Homogeneous, interleavings
from hydraulis.errors import OverlongError
from hydraulis.limits import check_lengths
from hydraulis.planner.phases import homogeneous_split
from hydraulis.planner.policy import PolicyContext
from hydraulis.planner.pool import homogeneous, largest_cap, replicable_configs
from hydraulis.planner.schedule import Schedule, mean_switch_time, phase_switch_time, phases_time


def switch_time(ctx: PolicyContext) -> float:
    """The parameters and the accumulated gradients into another layout (module docstring): a gradient
    sync's bytes, as the planner's phase change."""
    return phase_switch_time(ctx.cost, ctx.num_gpus)


class HotSpa:
    name = "hotspa"

    def __init__(self, ctx: PolicyContext) -> None:
        self.ctx = ctx
        self.cost = ctx.cost
        # Each config as its users may run it: with any interleaving of the recipes (`ParallelConfig.vp_choices`)
        # whose cap holds a range, or without, for the longer ranges interleaving's smaller cap leaves out.
        self.configs = [v for g in replicable_configs(ctx.cost, ctx.cluster) for v in (*interleavings(ctx, g), g)]
        self.caps = np.array([ctx.cost.cap(g, ctx.num_gpus) for g in self.configs])
        self.switch_s = switch_time(ctx)
        self._phase = {g: Homogeneous.on(ctx, homogeneous(g, ctx.cluster), "flops-balanced") for g in self.configs}
        # A phase after the first holds the earlier phases' accumulated gradient beside its activations (module
        # docstring), as the planner's phases do: its caps are `CostModel.later_phase`'s.
        self.later = ctx.cost.later_phase()
        later = dataclasses.replace(ctx, cost=self.later)
        self._later = {g: Homogeneous.on(later, homogeneous(g, ctx.cluster), "flops-balanced") for g in self.configs}

    def split(self, lengths: np.ndarray) -> list[tuple[np.ndarray, int]]:
        """(batch positions, config index) per phase, shortest range first; every sequence in one phase."""
        if not len(self.caps) or int(lengths.max()) > int(self.caps.max()):
            # The cuts stop at the largest cap: a longer sequence would be in no phase.
            cap, name = largest_cap(self.ctx.cost, self.ctx.cluster, lone=False)
            raise OverlongError(int(lengths.max()), cap, name, where="hotspa", policies=("truncate", "drop"),
                                scope=f"homogeneous, on {self.ctx.num_gpus} GPUs")
        return homogeneous_split(self.ctx.cost, self.ctx.num_gpus, self.configs, lengths, self.switch_s,
                                 later=self.later)

    def schedule(self, lengths: np.ndarray, step: int = 0) -> Schedule:
        start = time.perf_counter()
        lengths = check_lengths(lengths)
        plans, indices = [], []
        for n, (idx, k) in enumerate(self.split(lengths)):
            plans.append((self._later if n else self._phase)[self.configs[k]].plan(lengths[idx], step))
            indices.append(tuple(int(i) for i in idx))
        switch_s = mean_switch_time(plans, self.ctx.cost)
        total = phases_time(plans, self.ctx.cost, switch_s)
        return Schedule(
            step=step,
            lengths=tuple(int(s) for s in lengths),
            phases=tuple(plans),
            indices=tuple(indices),
            switch_s=switch_s,
            iteration_time_s=total,
            planning_time_s=time.perf_counter() - start,
        )
