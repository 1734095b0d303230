"""The deployment pool the planner chooses from, its file format, and the candidates it is built from.

A pool is the few deployments the planner may choose from each iteration; the
first is the homogeneous fallback (the cheapest config that holds the longest
sequence, replicated over all GPUs). `hydraulis propose` (proposal/) builds
pools; this module holds what a pool is and the pieces proposal starts from.

File format `hydraulis.pool/1`:

    {"schema": "hydraulis.pool/1", "profile": "llama-7b@a800-80g", "num_gpus": 32, "gpus_per_node": 8,
     "deployments": [{"text": "1x(tp8,pp1) + 12x(tp2,pp1)",
                      "replicas": [{"tp": 8, "pp": 1, "cp": 1, "devices": [0, 1, ...]}, ...],
                      "usage": 0.25}, ...]}

`text` is the compact form; `replicas` pins the devices (without it the
deployment is placed from `text`). `usage`, optional, is the share of the sampled
batches' tokens the planner ran on that deployment (whole or in phases) when the pool
was proposed; the shares add up to 1.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from hydraulis.cost.model import CostModel
from hydraulis.errors import CrowdedError, HydraulisError, OverlongError
from hydraulis.files import Fields, load_json, write_json_atomic
from hydraulis.limits import MAX_GPUS
from hydraulis.parallel import Deployment, ParallelConfig, format_configs, parse_deployment_configs
from hydraulis.planner.replicas import ReplicaCost, estimate_time
from hydraulis.specs import ClusterSpec, ModelSpec

POOL_SCHEMA = "hydraulis.pool/1"


@dataclass(frozen=True)
class Pool:
    profile: str
    cluster: ClusterSpec
    deployments: tuple[Deployment, ...]
    usage: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if not self.deployments:
            raise HydraulisError("a pool needs at least one deployment")
        for d in self.deployments:
            d.validate(self.cluster)
        if self.usage is not None and len(self.usage) != len(self.deployments):
            raise HydraulisError("pool usage needs one share per deployment")

    def to_dict(self) -> dict[str, Any]:
        rows = []
        for i, d in enumerate(self.deployments):
            row: dict[str, Any] = {"text": str(d), "replicas": d.to_rows()}
            if self.usage is not None:
                row["usage"] = round(float(self.usage[i]), 4)
            rows.append(row)
        return {
            "schema": POOL_SCHEMA,
            "profile": self.profile,
            "num_gpus": self.cluster.num_gpus,
            "gpus_per_node": self.cluster.gpus_per_node,
            "deployments": rows,
        }


def save_pool(path: str | Path, pool: Pool) -> None:
    data = pool.to_dict()
    write_json_atomic(path, data)


def load_pool(path: str | Path, cluster: ClusterSpec | None = None) -> Pool:
    """Read a pool file; if `cluster` is given, the pool must match its GPU count."""
    f = Fields(load_json(path, POOL_SCHEMA), str(path))
    pool_cluster = ClusterSpec(
        f.int("num_gpus", minimum=1, maximum=MAX_GPUS), f.int("gpus_per_node", default=8, minimum=1, maximum=MAX_GPUS)
    )
    if cluster is not None and cluster.num_gpus != pool_cluster.num_gpus:
        raise HydraulisError(f"{path}: the pool is for {pool_cluster.num_gpus} GPUs but --gpus is {cluster.num_gpus}")
    deployments, usage = [], []
    for i, row in enumerate(f.list("deployments")):
        r = Fields(row, f"{path}: deployments[{i}]")
        try:
            if "replicas" in row:
                deployments.append(Deployment.from_rows(r.list("replicas"), pool_cluster, f"{r.where}.replicas"))
            else:
                deployments.append(Deployment.parse(r.str("text"), pool_cluster))
        except HydraulisError as exc:
            if str(exc).startswith(str(path)):
                raise
            raise HydraulisError(f"{r.where}: {exc}") from None
        if "usage" in row:
            usage.append(r.float("usage", minimum=0))
    return Pool(
        f.str("profile", default="?"),
        pool_cluster,
        tuple(deployments),
        tuple(usage) if len(usage) == len(deployments) else None,
    )


def usable_configs(cost: CostModel, cluster: ClusterSpec) -> list[ParallelConfig]:
    """Configs with room for tokens that fit the cluster and its nodes (a TP group in a node or whole
    nodes; a CP group of those may span nodes)."""
    gpn = cluster.gpus_per_node
    out = []
    for g in cost.caps(cluster.num_gpus):
        cap = cost.lone_cap(g, cluster.num_gpus)  # a config whose replicas hold only lone micro-batches counts
        group_ok = gpn % g.tp == 0 or g.tp % gpn == 0
        if g.cp == 1:
            group_ok = gpn % g.group_size == 0 or g.group_size % gpn == 0
        if cap > 0 and group_ok:
            out.append(g)
    return out


def cp_roles(
    cost: CostModel, configs: Sequence[ParallelConfig], num_gpus: int, max_length: int, k: int = 3
) -> list[ParallelConfig]:
    """The few CP configs worth a place in candidate deployments, of those that hold `max_length`: where a
    cp = 1 config holds it too, only those that run it faster (a CP replica pays only on the longest
    sequences). The k fastest on it, then the smallest."""
    plain = [g for g in configs if g.cp == 1]
    cps = [g for g in configs if g.cp > 1 and cost.lone_cap(g, num_gpus) >= max_length]

    def trip(g: ParallelConfig) -> float:
        return g.pp * float(cost.stage_time(g, [max_length]))

    holding = [trip(g) for g in plain if cost.lone_cap(g, num_gpus) >= max_length]
    best_plain = min(holding) if holding else np.inf
    paying = [g for g in cps if trip(g) < best_plain]
    fastest = sorted(paying, key=lambda g: (trip(g), g.num_gpus))[:k]
    smallest = sorted(paying, key=lambda g: (g.num_gpus, trip(g)))[: max(1, k - 1)]
    return list(dict.fromkeys(fastest + smallest))


def largest_cap(
    cost: CostModel, cluster: ClusterSpec, pool: Sequence[Deployment] | None = None, lone: bool = True
) -> tuple[int, str]:
    """The largest cap (and its config) in the pool, or, without one, what a default pool can hold: the
    longest sequence a replica holds, as its lone micro-batch (`CostModel.lone_cap`); `lone=False`, in
    micro-batches of any count (the baselines', which pack every replica to the cap)."""
    configs = {g for d in pool for g in d.configs} if pool else set(replicable_configs(cost, cluster))
    if not configs:
        raise HydraulisError(f"no parallel config of {cost.name} replicates over {cluster.num_gpus} GPUs")
    holds = cost.lone_cap if lone else cost.cap
    best = max(configs, key=lambda g: (holds(g, cluster.num_gpus), -g.num_gpus))
    return holds(best, cluster.num_gpus), best.name


def check_job_pool(pool: Sequence[Deployment], world: int, model: ModelSpec, cost: CostModel, max_len: int) -> None:
    """A pool a training job of `world` ranks can run, for sequences up to `max_len`; else one clear error.

    Checked before any rank starts work: every deployment covers ranks
    0..world-1 exactly, every config suits the model's shape and is known to
    the cost model, and some config of the pool holds a max_len sequence.
    """
    if not pool:
        raise HydraulisError("the deployment pool is empty")
    if not cost.model.same_shape(model):
        raise HydraulisError(
            f"profile {cost.name} describes model {cost.model.name}, not the model trained ({model.name}); "
            "use a profile of this model (or MODEL@DEVICE for the analytic one)"
        )
    for d in pool:
        if d.num_gpus != world:
            raise HydraulisError(
                f"pool deployment {d} uses {d.num_gpus} GPUs but the job has {world} ranks; "
                "give a pool for this world size or change the number of processes"
            )
        ranks = sorted(dev for r in d.replicas for dev in r.devices)
        if ranks != list(range(world)):
            raise HydraulisError(f"pool deployment {d} places replicas on ranks {ranks}, not 0..{world - 1} once each")
        for g in d.configs:
            g.validate(model)
            if model.vocab_rows % g.tp:  # job.prepare pads for every config it expects; a safety net
                raise HydraulisError(
                    f"{g.name}: the vocabulary of {model.vocab_rows} rows is not divisible by tp={g.tp}"
                )
            cost.index(g)
    cap, name = largest_cap(cost, ClusterSpec(world, max(world, 1)), pool)
    if max_len > cap:
        raise HydraulisError(
            f"model {model.name} fits no config of the pool at max_len {max_len}: the largest cap is {cap} tokens "
            f"({name}); lower max_len or add replicas with more TP, PP or CP"
        )


def unique_deployments(deployments: Sequence[Deployment]) -> list[Deployment]:
    """The deployments in order, each once (by its compact text)."""
    seen: dict[str, Deployment] = {}
    for d in deployments:
        seen.setdefault(str(d), d)
    return list(seen.values())


def place(configs: Sequence[ParallelConfig], cluster: ClusterSpec) -> Deployment | None:
    try:
        return Deployment.place(list(configs), cluster)
    except HydraulisError:
        return None


def homogeneous_estimate(
    cost: CostModel, config: ParallelConfig, num_gpus: int, batches: Sequence[np.ndarray]
) -> float:
    """Mean estimated time of a batch spread evenly over N / n_g replicas of `config`."""
    times = [float(range_estimates(cost, config, num_gpus, s=np.sort(b), lo=np.array([0]), hi=np.array([len(b)]))[0])
             for b in batches if len(b)]
    return float(np.mean(times)) if times else float("inf")


def range_estimates(
    cost: CostModel, config: ParallelConfig, num_gpus: int, s: np.ndarray, lo: np.ndarray, hi: np.ndarray
) -> np.ndarray:
    """`homogeneous_estimate` of each range s[lo:hi] of the sorted lengths `s` at once (inf where empty):
    hotspa's split weighs every range between two cuts on every config."""
    r = ReplicaCost.of(cost, config, num_gpus)
    R = num_gpus // config.num_gpus
    w = r.seq_costs(np.asarray(s, dtype=np.int64))
    cw = np.concatenate([[0.0], np.cumsum(w)])
    ct = np.concatenate([[0], np.cumsum(s, dtype=np.int64)])
    n = hi - lo
    wmax = w[np.maximum(hi - 1, 0)]  # the costs grow with the length
    per = estimate_time(W=(cw[hi] - cw[lo]) / R, T=(ct[hi] - ct[lo]) // R + 1, n=np.maximum(1, n // R), wmax=wmax,
                        c=r.c, pp=1 + r.bubble_stages, cap=r.cap, min_efficient=r.min_efficient)
    return np.where(n > 0, np.maximum(per, r.pp * (wmax + r.c)), np.inf)


def fallback_config(
    cost: CostModel, cluster: ClusterSpec, max_length: int, batches: Sequence[np.ndarray], lone: bool = True
) -> ParallelConfig:
    """The cheapest config that holds `max_length` (`largest_cap`'s `lone`) and replicates over the cluster."""
    N = cluster.num_gpus
    holds = cost.lone_cap if lone else cost.cap
    holding = [g for g in replicable_configs(cost, cluster)
               if holds(g, N) >= max_length and has_room(cost, g, N, batches)]
    if not holding and (held := [g for g in replicable_configs(cost, cluster) if holds(g, N) >= max_length]):
        g = max(held, key=lambda g: (N // g.num_gpus, holds(g, N)))
        raise CrowdedError(max_length, g.name, holds(g, N), N, N // g.num_gpus)
    if not holding:
        cap, name = largest_cap(cost, cluster, lone=lone)
        cp = None if any(g.cp > 1 for g in cost.configs) else cost.name
        raise OverlongError(max_length, cap, name, scope=f"on {N} GPUs", cp_profile=cp)
    return min(holding, key=lambda g: (homogeneous_estimate(cost, g, N, batches), g.num_gpus))


def fallback_deployment(
    cost: CostModel, cluster: ClusterSpec, max_length: int, batches: Sequence[np.ndarray]
) -> Deployment:
    """The proposal's first deployment, which runs every batch: the homogeneous fallback where one has room;
    else the fewest replicas of a config fast on `max_length` that holds it as a lone micro-batch, beside
    replicas of the config fastest on the rest (each sequence beyond every cap needs a big replica alone)."""
    try:
        return homogeneous(fallback_config(cost, cluster, max_length, batches), cluster)
    except (OverlongError, CrowdedError) as exc:
        error = exc
    N = cluster.num_gpus
    usable = usable_configs(cost, cluster)
    bigs = sorted(
        (g for g in usable if cost.lone_cap(g, N) >= max_length),
        key=lambda g: (g.pp * cost.stage_time(g, [max_length]), g.num_gpus),
    )
    for big in bigs[:3]:
        for k in range(1, N // big.num_gpus):
            rest = N - k * big.num_gpus
            smalls = [g for g in usable
                      if rest % g.num_gpus == 0 and mixed_room(cost, big, k, small=g, num_gpus=N, batches=batches)]
            ranked = sorted(smalls, key=lambda g: homogeneous_estimate(
                cost, g, N, [b[b <= reach(cost, g, N)] for b in batches]))
            for small in ranked:
                if (d := place([big] * k + [small] * (rest // small.num_gpus), cluster)) is not None:
                    return d
    raise error


def mixed_room(
    cost: CostModel, big: ParallelConfig, k: int, small: ParallelConfig, num_gpus: int, batches: Sequence[np.ndarray]
) -> bool:
    """Whether k replicas of `big` beside `small` ones run every batch: sequences beyond big's cap alone, one
    big replica each; those beyond small's cap on the big replicas (so one must be left for them)."""
    big_cap, small_cap = reach(cost, big, num_gpus), reach(cost, small, num_gpus)
    for b in batches:
        b = np.asarray(b)
        alone, mid = int((b > big_cap).sum()), int(((b > small_cap) & (b <= big_cap)).sum())
        if alone > k or (alone == k and mid > 0):
            return False
    return True


def reach(cost: CostModel, config: ParallelConfig, num_gpus: int) -> int:
    """The most tokens a micro-batch of `config` beside others holds (its cap; under memory policies per
    micro-batch the heaviest's, `ReplicaCost.reach`): beyond it a sequence needs a replica alone."""
    return ReplicaCost.of(cost, config, num_gpus).reach


def has_room(cost: CostModel, config: ParallelConfig, num_gpus: int, batches: Sequence[np.ndarray]) -> bool:
    """Whether `config`'s homogeneous deployment can run every batch: a sequence beyond the cap runs alone on
    a replica (its lone micro-batch), so there must be a replica for each, and one more for the rest."""
    cap, replicas = reach(cost, config, num_gpus), num_gpus // config.num_gpus
    for b in batches:
        beyond = int((np.asarray(b) > cap).sum())
        if beyond > replicas or (beyond == replicas and len(b) > beyond):
            return False
    return True


def replicable_configs(cost: CostModel, cluster: ClusterSpec) -> list[ParallelConfig]:
    """Usable configs that replicate over the whole cluster (homogeneous deployments)."""
    N = cluster.num_gpus
    return [g for g in usable_configs(cost, cluster) if N % g.num_gpus == 0 and place([g] * (N // g.num_gpus), cluster)]


def is_pool_file(text: str) -> bool:
    """Whether a pool setting names a `hydraulis.pool/1` file (else it is an inline pool)."""
    return text.strip().endswith(".json") or Path(text).is_file()


def parse_pool(text: str, cluster: ClusterSpec, where: str = "--pool") -> tuple[Deployment, ...]:
    """`--pool`: compact deployments separated by ';', or a `hydraulis.pool/1` file."""
    if is_pool_file(text):
        return load_pool(text, cluster).deployments
    return tuple(Deployment.parse(t, cluster) for t in pool_items(text, where))


CONFIG_POOL = "parallel.pool"  # the config key of a job's pool (PoolSetting)


@dataclass(frozen=True)
class PoolSetting:
    """A job's `[parallel] pool`, told apart once: "auto" (proposed from the job's data), a file, or inline."""

    text: str
    kind: str  # "auto", "file" or "inline"

    @classmethod
    def parse(cls, text: str) -> PoolSetting:
        return cls(text, "auto" if text == "auto" else "file" if is_pool_file(text) else "inline")

    @property
    def auto(self) -> bool:
        return self.kind == "auto"

    def gpus(self) -> int | None:
        """The GPUs each of its deployments uses, checked before any placement; None for auto (the job sizes it)."""
        if self.kind == "inline":
            return inline_pool_world(self.text, CONFIG_POOL)
        return None if self.auto else load_pool(self.text).cluster.num_gpus

    def configs(self) -> tuple[ParallelConfig, ...]:
        """The configs its deployments use (none for auto, whose configs the proposal picks)."""
        if self.kind == "inline":
            return tuple(c for t in pool_items(self.text, CONFIG_POOL) for c in parse_deployment_configs(t))
        return () if self.auto else tuple(r.config for d in load_pool(self.text).deployments for r in d.replicas)


def pool_items(text: str, where: str = "--pool") -> tuple[str, ...]:
    """The deployments of an inline pool, compact texts separated by ';' (the one grammar of inline pools),
    checked whole: every part must parse (parallel.parse_deployment_configs), nothing is passed over."""
    items = tuple(t.strip() for t in text.split(";") if t.strip())
    if not items:
        raise HydraulisError(
            f"{where}: {text!r} names no deployment; give deployments like '16x(tp2,pp1); 1x(tp8,pp1) + 12x(tp2,pp1)'"
        )
    if where == CONFIG_POOL and "(" not in text and "x" not in text.lower():  # a word, not a deployment
        raise HydraulisError(f"{where} = {text!r}: neither \"auto\", a pool file that exists, nor deployments; write "
                             "\"auto\" (proposed from the data), a hydraulis.pool/1 file or '2x(tp1,pp1); 1x(tp2,pp1)'")
    for item in items:
        try:
            parse_deployment_configs(item)
        except HydraulisError as exc:
            raise HydraulisError(f"{where}: {exc}") from None
    return items


def inline_pool_world(text: str, where: str = CONFIG_POOL) -> int:
    """The GPU count of an inline pool, checked before any placement: every deployment must use the same."""
    items = pool_items(text, where)
    sizes = [sum(c.num_gpus for c in parse_deployment_configs(t)) for t in items]
    if len(set(sizes)) != 1:
        listed = ", ".join(f"{t} ({n} GPUs)" for t, n in zip(items, sizes, strict=True))
        raise HydraulisError(f"{where}: deployments use different GPU counts: {listed}")
    return sizes[0]


def homogeneous(config: ParallelConfig, cluster: ClusterSpec) -> Deployment:
    deployment = place([config] * (cluster.num_gpus // config.num_gpus), cluster)
    if deployment is None or deployment.num_gpus != cluster.num_gpus:
        raise HydraulisError(f"{config.name} does not replicate over {cluster.num_gpus} GPUs")
    return deployment


def homogeneous_cps(
    cost: CostModel, cluster: ClusterSpec, max_length: int, batches: Sequence[np.ndarray], k: int = 3
) -> list[ParallelConfig]:
    """The k CP configs whose homogeneous deployment holds `max_length` and is estimated fastest on the batches:
    fewer, larger replicas balance a batch of many short sequences better and pay c less often, which can outweigh
    the K/V all-gather (7b-32g-wikisample: 8x tp2pp1cp2 plans 3% faster than 16x tp2pp1)."""
    N = cluster.num_gpus
    cps = [g for g in replicable_configs(cost, cluster) if g.cp > 1 and cost.lone_cap(g, N) >= max_length]
    return sorted(cps, key=lambda g: homogeneous_estimate(cost, g, N, batches))[:k]


def candidate_deployments(
    cost: CostModel, cluster: ClusterSpec, max_length: int, batches: Sequence[np.ndarray], per_role: int = 3
) -> list[Deployment]:
    """Homogeneous deployments; k large replicas plus small ones filling the rest; and three tiers
    (a few replicas holding max_length, some mid-size, many small). CP configs (`cp_roles`) only as
    the large replicas or the top tier."""
    N = cluster.num_gpus
    configs = usable_configs(cost, cluster)
    # CP configs take the large roles only, and few of them: for short sequences cp replicas of a
    # config do the same work as one CP replica without its K/V all-gather.
    cps = list(dict.fromkeys(cp_roles(cost, configs, N, max_length, per_role)
                             + homogeneous_cps(cost, cluster, max_length, batches, per_role)))
    configs = [g for g in configs if g.cp == 1]
    cap = {g: cost.lone_cap(g, N) for g in configs + cps}  # the longest sequence each holds
    ranked = sorted(configs, key=lambda g: homogeneous_estimate(cost, g, N, [b[b <= cap[g]] for b in batches]))
    out: dict[str, Deployment] = {}

    def add(configs_: list[ParallelConfig]) -> None:
        key = format_configs(configs_)
        if key not in out and sum(g.num_gpus for g in configs_) == N and (d := place(configs_, cluster)):
            out[key] = d

    for g in ranked + cps:
        if N % g.num_gpus == 0:
            add([g] * (N // g.num_gpus))
    counts = (1, 2, 3, 4, 6, 8)
    for big in ranked + cps:
        for k, sm in itertools.product(counts, [g for g in ranked if cap[g] < cap[big]][:per_role]):
            rest = N - k * big.num_gpus
            if rest > 0 and rest % sm.num_gpus == 0:
                add([big] * k + [sm] * (rest // sm.num_gpus))
    for top in cps[:2] + [g for g in ranked if cap[g] >= max_length][:2]:
        for mid in [g for g in ranked if cap[g] < cap[top]][:per_role]:
            for sm in [g for g in ranked if cap[g] < cap[mid]][:2]:
                for k_top, k_mid in itertools.product((1, 2), (1, 2, 4)):
                    rest = N - k_top * top.num_gpus - k_mid * mid.num_gpus
                    if rest > 0 and rest % sm.num_gpus == 0:
                        add([top] * k_top + [mid] * k_mid + [sm] * (rest // sm.num_gpus))
    return list(out.values())
