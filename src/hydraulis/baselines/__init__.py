"""The policies compared by `hydraulis bench`: the planner and the other systems' algorithms.

Every policy is built from one PolicyContext (same cost model, cluster, pool)
and returns a Schedule per global batch (docs/design.md, section 5).
"""

from __future__ import annotations

from collections.abc import Callable

from hydraulis.errors import HydraulisError
from hydraulis.planner.policy import Policy, PolicyContext


def _hydraulis(ctx: PolicyContext) -> Policy:
    from hydraulis.planner.phases import PhasedPlanner

    return PhasedPlanner(ctx.cost, ctx.num_gpus, ctx.pool, zero_bubble=ctx.zero_bubble)


def _homogeneous(name: str) -> Callable[[PolicyContext], Policy]:
    def make(ctx: PolicyContext) -> Policy:
        from hydraulis.baselines.homogeneous import Homogeneous

        return Homogeneous(ctx, name)

    return make


def _hotspa(ctx: PolicyContext) -> Policy:
    from hydraulis.baselines.hotspa import HotSpa

    return HotSpa(ctx)


def _dynamic_cp(ctx: PolicyContext) -> Policy:
    from hydraulis.baselines.dynamic_cp import DynamicCP

    return DynamicCP(ctx)


def _slime(ctx: PolicyContext) -> Policy:
    from hydraulis.baselines.slime import SlimeFlops

    return SlimeFlops(ctx)


def _reference(ctx: PolicyContext) -> Policy:
    from hydraulis.baselines.reference import Reference

    return Reference(ctx)


POLICIES: dict[str, Callable[[PolicyContext], Policy]] = {
    "hydraulis": _hydraulis,
    "megatron": _homogeneous("megatron"),
    "token-balanced": _homogeneous("token-balanced"),
    "flops-balanced": _homogeneous("flops-balanced"),
    "hotspa": _hotspa,
    "megatron-dcp": _dynamic_cp,
    "slime-flops": _slime,
    "hydraulis-reference": _reference,
}


OWN_CONFIGS = ("megatron-dcp",)  # CP group sizes of its own cost model: no plan file of the profile holds them


def make_policy(name: str, ctx: PolicyContext) -> Policy:
    try:
        factory = POLICIES[name]
    except KeyError:
        raise HydraulisError(f"unknown policy {name!r}; policies: {', '.join(POLICIES)}") from None
    return factory(ctx)
