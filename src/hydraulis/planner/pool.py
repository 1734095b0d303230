"""The deployment pool the planner chooses from, and the homogeneous fallback.

`default_pool` is a stand-in for the data-aware proposal (issue 4), kept small
so that it can be swapped: it scores a handful of candidates (every homogeneous
deployment, and mixes of a few large replicas that hold the longest sequence
with many small ones) by dispatch estimates on sample batches and keeps the
few that together serve the batches best. The first deployment is always the
homogeneous fallback: the cheapest config that holds the longest sequence,
replicated over all GPUs.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from hydraulis.cost.model import CostModel
from hydraulis.errors import HydraulisError
from hydraulis.parallel import Deployment, ParallelConfig, format_configs
from hydraulis.planner.replicas import ReplicaCost, estimate_time
from hydraulis.specs import ClusterSpec


def usable_configs(cost: CostModel, cluster: ClusterSpec) -> list[ParallelConfig]:
    """Configs with room for tokens that fit the cluster and its nodes."""
    gpn = cluster.gpus_per_node
    out = []
    for g, cap in cost.caps(cluster.num_gpus).items():
        group_ok = gpn % g.group_size == 0 or g.group_size % gpn == 0
        if cap > 0 and group_ok:
            out.append(g)
    return out


def largest_cap(cost: CostModel, cluster: ClusterSpec, pool: Sequence[Deployment] | None = None) -> tuple[int, str]:
    """The largest cap (and its config) in the pool, or, without one, what a default pool can hold."""
    configs = {g for d in pool for g in d.configs} if pool else set(replicable_configs(cost, cluster))
    if not configs:
        raise HydraulisError(f"no parallel config of {cost.name} replicates over {cluster.num_gpus} GPUs")
    best = max(configs, key=lambda g: (cost.cap(g, cluster.num_gpus), -g.num_gpus))
    return cost.cap(best, cluster.num_gpus), best.name


def place(configs: Sequence[ParallelConfig], cluster: ClusterSpec) -> Deployment | None:
    try:
        return Deployment.place(list(configs), cluster)
    except HydraulisError:
        return None


def homogeneous_estimate(
    cost: CostModel, config: ParallelConfig, num_gpus: int, batches: Sequence[np.ndarray]
) -> float:
    """Mean estimated time of a batch spread evenly over N / n_g replicas of `config`."""
    r = ReplicaCost.of(cost, config, num_gpus)
    R = num_gpus // config.num_gpus
    times = []
    for lengths in batches:
        if len(lengths) == 0:
            continue
        w = r.seq_costs(lengths)
        per = estimate_time(
            w.sum() / R,
            int(lengths.sum()) // R + 1,
            max(1, len(lengths) // R),
            w.max(),
            r.c,
            r.pp,
            r.cap,
            r.min_efficient,
        )
        times.append(float(max(per, r.pp * (w.max() + r.c))))
    return float(np.mean(times)) if times else float("inf")


def fallback_config(
    cost: CostModel, cluster: ClusterSpec, max_length: int, batches: Sequence[np.ndarray]
) -> ParallelConfig:
    """The cheapest config that holds `max_length` and replicates over the whole cluster."""
    N = cluster.num_gpus
    holding = [g for g in replicable_configs(cost, cluster) if cost.cap(g, N) >= max_length]
    if not holding:
        cap, name = largest_cap(cost, cluster)
        raise HydraulisError(
            f"a sequence of {max_length} tokens is longer than the largest cap on {N} GPUs "
            f"({cap} tokens, {name}); use --overlong truncate|drop or more GPUs"
        )
    return min(holding, key=lambda g: (homogeneous_estimate(cost, g, N, batches), g.num_gpus))


def replicable_configs(cost: CostModel, cluster: ClusterSpec) -> list[ParallelConfig]:
    """Usable configs that replicate over the whole cluster (homogeneous deployments)."""
    N = cluster.num_gpus
    return [g for g in usable_configs(cost, cluster) if N % g.num_gpus == 0 and place([g] * (N // g.num_gpus), cluster)]


def parse_pool(text: str, cluster: ClusterSpec) -> tuple[Deployment, ...]:
    """`--pool`: compact deployments separated by ';', or a `hydraulis.pool/1` file."""
    if text.strip().endswith(".json") or Path(text).is_file():
        return load_pool_file(text, cluster)
    items = [t for t in text.split(";") if t.strip()]
    if not items:
        raise HydraulisError("--pool is empty; give deployments like '16x(tp2,pp1); 1x(tp8,pp1) + 12x(tp2,pp1)'")
    return tuple(Deployment.parse(t, cluster) for t in items)


def load_pool_file(path: str | Path, cluster: ClusterSpec) -> tuple[Deployment, ...]:
    """Hook for the `hydraulis.pool/1` format of the proposal (issue 4)."""
    raise HydraulisError(f"{path}: pool files (hydraulis.pool/1) are not supported yet; give the pool inline")


def homogeneous(config: ParallelConfig, cluster: ClusterSpec) -> Deployment:
    deployment = place([config] * (cluster.num_gpus // config.num_gpus), cluster)
    if deployment is None or deployment.num_gpus != cluster.num_gpus:
        raise HydraulisError(f"{config.name} does not replicate over {cluster.num_gpus} GPUs")
    return deployment


def candidate_deployments(
    cost: CostModel, cluster: ClusterSpec, max_length: int, batches: Sequence[np.ndarray], per_role: int = 3
) -> list[Deployment]:
    """Homogeneous deployments; k large replicas plus small ones filling the rest; and three tiers
    (a few replicas holding max_length, some mid-size, many small)."""
    N = cluster.num_gpus
    configs = usable_configs(cost, cluster)
    ranked = sorted(configs, key=lambda g: homogeneous_estimate(cost, g, N, [b[b <= cost.cap(g, N)] for b in batches]))
    cap = {g: cost.cap(g, N) for g in configs}
    out: dict[str, Deployment] = {}

    def add(configs_: list[ParallelConfig]) -> None:
        key = format_configs(configs_)
        if key not in out and sum(g.num_gpus for g in configs_) == N and (d := place(configs_, cluster)):
            out[key] = d

    for g in ranked:
        if N % g.num_gpus == 0:
            add([g] * (N // g.num_gpus))
    counts = (1, 2, 3, 4, 6, 8)
    for big in ranked:
        for k, sm in itertools.product(counts, [g for g in ranked if cap[g] < cap[big]][:per_role]):
            rest = N - k * big.num_gpus
            if rest > 0 and rest % sm.num_gpus == 0:
                add([big] * k + [sm] * (rest // sm.num_gpus))
    for top in [g for g in ranked if cap[g] >= max_length][:2]:
        for mid in [g for g in ranked if cap[g] < cap[top]][:per_role]:
            for sm in [g for g in ranked if cap[g] < cap[mid]][:2]:
                for k_top, k_mid in itertools.product((1, 2), (1, 2, 4)):
                    rest = N - k_top * top.num_gpus - k_mid * mid.num_gpus
                    if rest > 0 and rest % sm.num_gpus == 0:
                        add([top] * k_top + [mid] * k_mid + [sm] * (rest // sm.num_gpus))
    return list(out.values())


def default_pool(
    cost: CostModel,
    cluster: ClusterSpec,
    batches: Sequence[np.ndarray],
    max_length: int | None = None,
    size: int = 5,
) -> tuple[Deployment, ...]:
    """The fallback plus up to size - 1 deployments that most lower the sample batches' estimated times."""
    from hydraulis.planner.dispatch import dispatch
    from hydraulis.planner.replicas import ReplicaTable

    batches = [np.asarray(b, dtype=np.int64) for b in batches if len(b)]
    if not batches:
        raise HydraulisError("cannot build a deployment pool without sample batches")
    longest = max_length or max(int(b.max()) for b in batches)
    fallback = homogeneous(fallback_config(cost, cluster, longest, batches), cluster)
    sample = batches[:4]
    scores = []
    candidates = candidate_deployments(cost, cluster, longest, sample)
    for d in candidates:
        table = ReplicaTable.of(cost, d, cluster.num_gpus)
        top = int(table.cap.max())
        scores.append([dispatch(b, table, search=False).makespan_s if int(b.max()) <= top else np.inf for b in sample])
    score = np.array(scores)  # [candidates, batches]
    chosen = [next(i for i, d in enumerate(candidates) if str(d) == str(fallback))]
    best = score[chosen[0]].copy()
    while len(chosen) < size:
        gain = (best[None, :] - np.minimum(score, best[None, :])).sum(axis=1)
        k = int(np.argmax(gain))
        if gain[k] <= 1e-3 * best.sum():
            break
        chosen.append(k)
        best = np.minimum(best, score[k])
    return tuple(candidates[i] for i in chosen)
