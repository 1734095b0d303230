"""The policies compared by `hydraulis bench`: the planner and the other systems' algorithms.

Every policy is built from one PolicyContext (same cost model, cluster, pool)
and returns a Schedule per global batch (DESIGN section 7).
"""

from __future__ import annotations

from collections.abc import Callable

from hydraulis.errors import HydraulisError
from hydraulis.planner.policy import Policy, PolicyContext


def _hydraulis(ctx: PolicyContext) -> Policy:
    from hydraulis.planner.planner import Planner

    return Planner(ctx.cost, ctx.num_gpus, ctx.pool)


POLICIES: dict[str, Callable[[PolicyContext], Policy]] = {
    "hydraulis": _hydraulis,
}


def make_policy(name: str, ctx: PolicyContext) -> Policy:
    try:
        factory = POLICIES[name]
    except KeyError:
        raise HydraulisError(f"unknown policy {name!r}; policies: {', '.join(POLICIES)}") from None
    return factory(ctx)
