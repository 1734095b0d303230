"""What the planner needs to know about a replica, and the 1F1B time estimate both stages share.

Dispatch cannot afford to pack and simulate for every candidate move, so it
works with an estimate of the packed replica's 1F1B time from four sums of its
sequences (cost W, tokens T, count n, largest cost w_max):

    est = min over v of  W + v*c + (pp - 1) * (max(W / v, w_max) + c)

v runs from the token-cap minimum ceil(T / cap) up to the count n (and down to
T / min_efficient_tokens, below which a micro-batch leaves the GPU idle); the
unconstrained optimum is v* = sqrt((pp - 1) * W / c). For pp = 1 this is W + c*ceil(T/cap).

Interleaved (vp > 1) the pp - 1 above is (pp - 1) / vp, and fewer micro-batches than stages wait for their
chunks to come round: stage 0 runs chunk k + 1 of the first micro-batch only after it crossed the pp stages,
so the replica takes pp (W / v + c) + (v - 1) / vp (W / v + c) for v equal ones (`planner/sim.py`), which the
estimate adds as (pp - v)(1 - 1 / vp)(W / v + c) where v < pp (`ReplicaCost.wrap`).

With memory policies per micro-batch (`CostModel.with_policies`), a sequence beyond the cap but within a
recompute policy's cap (`tiers`) runs as its own micro-batch under the lightest policy that holds it, its
cost scaled by the policy's (`ReplicaCost.seq_costs`) beside the others.

A sequence longer than these caps (but within the lone cap, `CostModel.lone_cap`) fits only a replica's
lone micro-batch: a replica holding one runs everything it holds as one micro-batch of at most the lone
cap, in pp (W + c), and cannot hold more (estimate infinite).
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from hydraulis.cost.activations import COUNT_HORIZON, count_horizon, counted
from hydraulis.cost.model import CostModel, sequence_costs
from hydraulis.cost.policies import MemoryPolicy
from hydraulis.parallel import Deployment, ParallelConfig

# Large batches: below this many sequences every step goes one sequence at a time (the bench's batches);
# above it, sequences lighter than HEAVY_SHARE of a fair share of the work are placed in bulk.
BULK_MIN_SEQUENCES = 8192
HEAVY_SHARE = 1 / 16
# `ReplicaCost.of`'s replicas per cost model as it is: keyed by its `later_phase` copy, renewed once it changes
_KEPT: weakref.WeakKeyDictionary[CostModel, dict] = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class Tier:
    """A memory policy's cap on a config and the coefficients a micro-batch runs at under it."""

    policy: MemoryPolicy
    cap: int
    a: float
    b: float


@dataclass(frozen=True)
class ReplicaCost:
    """Coefficients, cap and busy threshold of one config in a job of N GPUs."""

    config: ParallelConfig
    a: float
    b: float
    c: float
    cap: int
    min_efficient: int
    lone_cap: int | None = None  # a replica's only micro-batch (default: the cap)
    # Memory policies beyond the plain one (`CostModel.with_policies`), each cap above the one before: a
    # micro-batch of up to `tiers[k].cap` tokens beside others; `lone_tiers`, a lone one (the plain first).
    tiers: tuple[Tier, ...] = ()
    lone_tiers: tuple[Tier, ...] = ()
    plain: MemoryPolicy = MemoryPolicy.NONE  # the policy of a micro-batch within the cap (full: the recompute set)
    # Where the planner chooses a policy per micro-batch: a policy's cap at the replica's own count (`micro_batch_cap`,
    # `counted`: interleaved every count, 1F1B below pp), read when a micro-batch is beyond the any-count cap.
    count_cap: Callable[[int, MemoryPolicy], int] | None = field(default=None, compare=False, repr=False)
    # The most micro-batches `cap` and `tiers` hold for (`count_horizon`: a batch of n sequences packs at most n
    # on a replica, so its decisions read the least cap of counts 2..n); beyond it each count's own (`policy`).
    horizon: int = COUNT_HORIZON
    # Each count's policy steps (`steps`), made on first use: packing asks them of every micro-batch it prices.
    _steps: dict[int, tuple[np.ndarray, tuple[MemoryPolicy | None, ...]]] = field(
        default_factory=dict, compare=False, repr=False)

    @property
    def pp(self) -> int:
        return self.config.pp

    @property
    def bubble_stages(self) -> float:
        """The stages' worth of warm-up and cool-down a replica pays: pp - 1 under 1F1B, (pp - 1) / vp
        interleaved (its chunks are 1/vp of a stage). The estimates' pp - 1; a lone micro-batch still makes pp
        trips."""
        return self.pp - 1 if self.config.vp == 1 else (self.pp - 1) / self.config.vp

    @property
    def wrap(self) -> int:
        """The pp below which an interleaved replica's micro-batches wait for their chunks to come round; 0 under
        1F1B, where v < pp costs what the estimate says."""
        return self.pp if self.config.vp > 1 else 0

    @property
    def reach(self) -> int:
        """The most tokens a micro-batch beside others holds, under the heaviest policy."""
        return self.tiers[-1].cap if self.tiers else self.cap

    @property
    def holds(self) -> int:
        """The longest sequence a replica of this config holds: its lone micro-batch's cap."""
        return max(self.reach, self.cap if self.lone_cap is None else self.lone_cap)

    @property
    def plain_lone(self) -> int:
        """The most tokens of a lone micro-batch under the plain policy."""
        plain = [t.cap for t in self.lone_tiers if t.policy == self.plain]
        return plain[0] if plain else (self.cap if self.lone_tiers else self.holds)

    @property
    def long_w(self) -> float:
        """The cost of a sequence of `reach` tokens: a replica whose w_max exceeds it holds a longer one. A lone
        micro-batch's lighter policy may cost less just beyond `reach` than a heavier one beside others at it
        (70b, tp1pp16: selective alone against full); then the cost just beyond it, so that every longer
        sequence counts as lone (and the heaviest below it too, which only makes the estimate cautious)."""
        at, beyond = self.seq_costs(np.array([self.reach, self.reach + 1]))
        return float(min(at, beyond * (1 - 1e-9)))

    @classmethod
    def of(cls, cost: CostModel, config: ParallelConfig, num_gpus: int, most: int = COUNT_HORIZON) -> ReplicaCost:
        """`most`: the most micro-batches a decision on these caps may lead to (`count_horizon`). Kept per model
        (`_KEPT`): every planner of the proposal's trials asks again, and its policy steps (`steps`) stay found."""
        horizon, kept = count_horizon(config, most), _KEPT.setdefault(cost.later_phase(), {})
        if (config, num_gpus, horizon) in kept:
            return kept[config, num_gpus, horizon]
        k = cost.coefficients(config)
        cap, lone = cost.cap(config, num_gpus, horizon), cost.lone_cap(config, num_gpus)
        tiers: dict[int | None, list[Tier]] = {None: [], 1: []}
        for count, rows in tiers.items():
            top = cap if count is None else 0
            for p in cost.policies(config)[count is None:]:
                at = cost.policy_cap(config, num_gpus, p, count, horizon)
                if at > top:
                    sa, sb = cost.policy_scale(config, p)
                    rows.append(Tier(p, at, sa * k.a, sb * k.b))
                    top = at
            # A policy slower than a heavier one (measured factors can say so) is never the better choice.
            rows[:] = [t for j, t in enumerate(rows) if all(t.a <= u.a and t.b <= u.b for u in rows[j + 1 :])]
        count_cap = functools.partial(cost.micro_batch_cap, config, num_gpus) if cost.memory_policies else None
        return kept.setdefault((config, num_gpus, horizon), cls(
            config=config, a=k.a, b=k.b, c=k.c, cap=cap, min_efficient=cost.min_efficient_tokens(config), lone_cap=lone,
            tiers=tuple(tiers[None]), lone_tiers=tuple(tiers[1]), plain=cost.policies(config)[0],
            count_cap=count_cap if config.pp > 1 else None, horizon=horizon))

    def seq_costs(self, lengths: np.ndarray) -> np.ndarray:
        """a*s^2 + b*s of each sequence, under the lightest policy whose cap holds it alone (beyond `reach`,
        its lone micro-batch's); plain up to the plain lone cap, where a replica may run it alone instead."""
        out = sequence_costs(self.a, self.b, lengths)
        if not self.tiers and len(self.lone_tiers) < 2:
            return out  # no policy beyond the plain one
        s = np.asarray(lengths)
        lone = tuple(t for t in self.lone_tiers if t.policy != self.plain)
        # Within the plain lone cap a replica may run it alone instead, unscaled (packing tries both).
        for tiers, low in ((self.tiers, max(self.cap, self.plain_lone)), (lone, max(self.reach, self.plain_lone))):
            for tier in tiers:
                at = (s > low) & (s <= tier.cap)
                out = np.where(at, sequence_costs(tier.a, tier.b, s), out)
                low = max(low, tier.cap)
        return out

    def lightest(self, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Each sequence's least stage cost a*s^2 + b*s beside others and as the replica's lone micro-batch: under
        the lightest policy whose cap (`cap` and `tiers`; `lone_tiers`, or without policies the lone cap) holds
        it, inf where none does. A lone one may run a lighter policy than beside others (selective alone past
        full's cap beside others); a lower bound takes the least of both."""
        s = np.asarray(lengths, dtype=np.int64)
        plain = sequence_costs(self.a, self.b, s)
        beside = np.where(s <= self.cap, plain, np.inf)
        for tier in self.tiers:
            beside = np.where((s <= tier.cap) & ~np.isfinite(beside), sequence_costs(tier.a, tier.b, s), beside)
        if not self.lone_tiers:
            return beside, np.where(s <= self.holds, plain, np.inf)
        alone = np.full(len(s), np.inf)
        for tier in self.lone_tiers:  # lightest first
            alone = np.where((s <= tier.cap) & ~np.isfinite(alone), sequence_costs(tier.a, tier.b, s), alone)
        return beside, alone

    def least(self, lengths: np.ndarray) -> np.ndarray:
        """Each sequence's least stage cost on this config, beside others or alone (`lightest`); inf where it holds
        none: what a lower bound or a shape for the longest prices a sequence at."""
        return np.minimum(*self.lightest(lengths))

    @property
    def estimate_cap(self) -> int:
        """The token cap the estimates count micro-batches by: interleaved, that of counts whose group is pp, which
        the packing takes where the cap sets the count (`cap_at`)."""
        return self.cap_at(2 * self.pp) if self.config.vp > 1 else self.cap

    def cap_at(self, micro_batches: int) -> int:
        """The plain policy's cap of each of `micro_batches` micro-batches: at that count where the planner chooses
        per micro-batch and the count may hold other than the worst in flight (`counted`), else `cap`."""
        if self.count_cap is None or micro_batches < 2 or counted(self.config, micro_batches) is None:
            return self.cap
        return self.count_cap(micro_batches, self.plain)

    def at_count(self, micro_batches: int) -> ReplicaCost | None:
        """This config with the plain policy's cap at one count of micro-batches (`cap_at`; the tiers above it as they
        are, for counts to the horizon, which hold at most what the count's do), for packings made for that count,
        which `fits` checks at their own; None where the caps do not follow the count."""
        if self.count_cap is None or micro_batches < 2 or counted(self.config, micro_batches) is None:
            return None
        cap = self.count_cap(micro_batches, self.plain)
        return dataclasses.replace(self, cap=cap, tiers=tuple(t for t in self.tiers if t.cap > cap), horizon=1)

    def fits(self, micro_batches: Sequence[np.ndarray], lengths: np.ndarray) -> bool:
        """Whether every one of these micro-batches (of batch indices) fits some policy at their count: the plain
        one's cap there (`cap_at`), else the heaviest's where the caps follow the count (a lone one: `holds`)."""
        count, most = len(micro_batches), max(int(lengths[mb].sum()) for mb in micro_batches)
        if count == 1:
            return most <= self.holds
        if most <= self.cap_at(count):
            return True
        if self.count_cap is None or counted(self.config, count) is None:
            return False
        return most <= self.count_cap(count, self.tiers[-1].policy if self.tiers else self.plain)

    def policy(self, tokens: int, micro_batches: int) -> MemoryPolicy | None:
        """The policy a micro-batch of `tokens` (one of `micro_batches`) runs: the lightest whose cap holds it;
        None for the config's plain one (or where none holds it, which a plan's validation names)."""
        limits, policies = self.steps(micro_batches)
        return next((p for limit, p in zip(limits.tolist(), policies, strict=True) if tokens <= limit), None)

    def policies_of(self, tokens: Sequence[int]) -> tuple[MemoryPolicy, ...]:
        """A plan's policies of micro-batches of these `tokens` (`policy`; empty where every one runs the plain one)."""
        chosen = [self.policy(int(t), len(tokens)) for t in tokens]
        return () if all(p is None for p in chosen) else tuple(self.plain if p is None else p for p in chosen)

    def steps(self, micro_batches: int) -> tuple[np.ndarray, tuple[MemoryPolicy | None, ...]]:
        """`policy` at one count as limits and policies: a micro-batch runs the policy of the first limit that holds
        it (None: the plain one; past every limit, None too). Kept per count (`_steps`)."""
        found = self._steps.get(micro_batches)
        if found is None:
            found = self._steps[micro_batches] = self._policy_steps(micro_batches)
        return found

    def _policy_steps(self, micro_batches: int) -> tuple[np.ndarray, tuple[MemoryPolicy | None, ...]]:
        """Lone: the lone tiers, lightest first. Beside others: the cap (it holds every count to the horizon; one
        not counted, every count); then where the caps follow the count (`counted`) each policy's cap at it, the
        plain one's and the tiers' (those never slower than a heavier), else the tiers' own."""
        if micro_batches == 1:
            rows = [(t.cap, t.policy) for t in self.lone_tiers]
        elif self.count_cap is not None and counted(self.config, micro_batches) is not None:
            rows = [(self.cap, None)] if micro_batches <= self.horizon else []
            rows += [(self.count_cap(micro_batches, p), p) for p in (self.plain, *(t.policy for t in self.tiers))]
        else:
            rows = [(self.cap, None)] + [(t.cap, t.policy) for t in self.tiers]
        limits = np.array([limit for limit, _ in rows], dtype=np.int64)
        return limits, tuple(None if p == self.plain else p for _, p in rows)


@dataclass(frozen=True)
class ReplicaTable:
    """Per-replica arrays of a deployment, for vectorised estimates."""

    replicas: tuple[ReplicaCost, ...]
    c: np.ndarray
    pp: np.ndarray
    cap: np.ndarray  # `ReplicaCost.estimate_cap` of each replica
    min_efficient: np.ndarray
    group: np.ndarray  # index into `configs` per replica
    configs: tuple[ReplicaCost, ...]  # distinct configs, first-appearance order
    lone_cap: np.ndarray  # the longest sequence each replica holds (`ReplicaCost.holds`)
    long_w: np.ndarray  # the cost of a cap-long sequence on each replica (`ReplicaCost.long_w`)
    wrap: np.ndarray  # `ReplicaCost.wrap` of each replica

    @property
    def params(self) -> tuple[np.ndarray, ...]:
        """The per-replica arguments of `estimate_time` after the four sums."""
        return (self.c, self.pp, self.cap, self.min_efficient, self.lone_cap, self.long_w, self.wrap)

    @classmethod
    def of(
        cls, cost: CostModel, deployment: Deployment | Sequence[ParallelConfig], num_gpus: int,
        most: int = COUNT_HORIZON,
    ) -> ReplicaTable:
        """`most`: the most micro-batches a replica may pack (`ReplicaCost.of`)."""
        configs = deployment.configs if isinstance(deployment, Deployment) else tuple(deployment)
        distinct: dict[ParallelConfig, int] = {}
        for g in configs:
            distinct.setdefault(g, len(distinct))
        models = tuple(ReplicaCost.of(cost, g, num_gpus, most) for g in distinct)
        reps = tuple(models[distinct[g]] for g in configs)
        return cls(
            replicas=reps,
            c=np.array([r.c for r in reps]),
            pp=np.array([1 + r.bubble_stages for r in reps], dtype=np.float64),  # the estimates' pp: its bubble
            cap=np.array([r.estimate_cap for r in reps], dtype=np.int64),
            min_efficient=np.array([r.min_efficient for r in reps], dtype=np.int64),
            group=np.array([distinct[g] for g in configs], dtype=np.int64),
            configs=models,
            lone_cap=np.array([r.holds for r in reps], dtype=np.int64),
            long_w=np.array([r.long_w for r in reps]),
            wrap=np.array([r.wrap for r in reps], dtype=np.float64),
        )

    def __len__(self) -> int:
        return len(self.replicas)

    def compute_bound(self, lengths: np.ndarray) -> float:
        """A lower bound on the simulated compute of any plan of `lengths` on this deployment (GPU timing, not
        shared cores), to skip packing one that cannot win. A 1F1B replica's last stage runs every micro-batch,
        W + v*c, so the slowest replica takes at least the mean of that; the one holding the longest sequence
        at least its micro-batch plus (pp - 1) c of warm-up and cool-down, pp times it where it runs alone
        (beyond the config's reach). A sequence costs a config at least its cost under the lightest policy
        that holds it there, beside others or alone (`ReplicaCost.lightest`, as the bench's bound prices it)."""
        s = np.asarray(lengths, dtype=np.int64)
        models = self.configs
        w = np.stack([m.least(s) for m in models])  # [configs, n]; inf where a config cannot hold it
        c = np.array([m.c for m in models])
        longest = int(s.max())
        micro_batches = -(-int(s.sum()) // int(self.lone_cap.max()))
        mean = (float(w.min(axis=0).sum()) + float(c.min()) * micro_batches) / len(self)
        pp = np.array([m.pp for m in models], dtype=np.float64)
        bubble = np.array([m.bubble_stages for m in models], dtype=np.float64)
        alone = np.array([longest > m.reach for m in models])
        one = w[:, int(np.argmax(s))] + c
        holding = np.where(alone, pp * one, one + bubble * c)[[m.holds >= longest for m in models]]
        return max(mean, float(holding.min()) if len(holding) else np.inf)

    def cost_matrix(self, lengths: np.ndarray) -> np.ndarray:
        """[distinct configs x sequences] of a*s^2 + b*s (under the policy each needs, `ReplicaCost.seq_costs`)."""
        if any(m.tiers or len(m.lone_tiers) > 1 for m in self.configs):
            return np.stack([m.seq_costs(np.asarray(lengths)) for m in self.configs])
        a = np.array([m.a for m in self.configs])[:, None]
        b = np.array([m.b for m in self.configs])[:, None]
        return sequence_costs(a, b, np.asarray(lengths)[None, :])


ArrayLike = np.ndarray | float | int  # the estimate broadcasts: arrays of replicas, or one replica's scalars


def micro_batch_range(
    tokens: ArrayLike, count: ArrayLike, cap: ArrayLike, min_efficient: ArrayLike
) -> tuple[np.ndarray, np.ndarray]:
    """Smallest and largest sensible micro-batch counts (arrays or scalars)."""
    tokens = np.asarray(tokens)
    vmin = np.maximum(1, -(-tokens // np.maximum(cap, 1)))
    busy = tokens // np.maximum(min_efficient, 1)
    vmax = np.maximum(vmin, np.minimum(count, busy))
    return vmin, vmax


def estimate_time(
    W: ArrayLike,
    T: ArrayLike,
    n: ArrayLike,
    wmax: ArrayLike,
    c: ArrayLike,
    pp: ArrayLike,
    cap: ArrayLike,
    min_efficient: ArrayLike,
    lone_cap: ArrayLike | None = None,
    long_w: ArrayLike | None = None,
    wrap: ArrayLike | None = None,
) -> np.ndarray:
    """Estimated 1F1B time of replicas holding sequences with these sums (broadcasts; 0 if empty).

    With `lone_cap` and `long_w`: a replica whose w_max exceeds long_w holds a sequence longer than the
    cap, so all of it runs as one micro-batch, pp (W + c), if T fits the lone cap, else never (inf). With
    `wrap` (`ReplicaCost.wrap`), an interleaved replica's fewer micro-batches than stages wait for their chunks.
    """
    W = np.asarray(W, dtype=np.float64)
    c = np.asarray(c, dtype=np.float64)
    pp1 = np.asarray(pp, dtype=np.float64) - 1.0
    vmin, vmax = micro_batch_range(T, n, cap, min_efficient)
    shape = np.broadcast_shapes(*map(np.shape, (W, T, n, wmax, c, pp1, cap, min_efficient, lone_cap, long_w, wrap)))
    # In place where it can (the local search's swaps estimate a few hundred thousand pairs at once); the same
    # operations in the same order as W + v c + pp1 (max(W / v, wmax) + c). fmax: an emptied replica's W may
    # be a rounding below 0, and pp = 1 with W = inf (a lone sequence past its cap) is 0 * inf; neither has a
    # micro-batch count to choose.
    v1 = np.multiply(pp1, W, out=np.empty(shape))
    np.fmax(v1, 0.0, out=v1)
    v1 /= np.maximum(c, 1e-12)
    np.sqrt(v1, out=v1)
    np.floor(v1, out=v1)
    v2 = np.add(v1, 1.0, out=np.empty(shape))
    for v in (v1, v2):
        np.minimum(np.maximum(v, vmin, out=v), vmax, out=v)
    est = _one_f_one_b(W=W, v=v1, wmax=wmax, c=c, pp1=pp1, wrap=wrap)
    np.minimum(est, _one_f_one_b(W=W, v=v2, wmax=wmax, c=c, pp1=pp1, wrap=wrap), out=est)
    if lone_cap is not None and long_w is not None:
        beyond = np.asarray(wmax) > long_w
        if beyond.any():
            trips = pp1 + 1.0 if wrap is None else np.maximum(pp1 + 1.0, wrap)  # interleaved: pp, not 1 + pp1
            lone = np.where(np.asarray(T) <= lone_cap, trips * (W + c), np.inf)
            est = np.where(beyond, lone, est)
    return np.where(np.asarray(n) > 0, est, 0.0)


def _one_f_one_b(
    W: np.ndarray, v: np.ndarray, wmax: ArrayLike, c: np.ndarray, pp1: np.ndarray, wrap: ArrayLike | None = None
) -> np.ndarray:
    """W + v c + pp1 (max(W / v, wmax) + c), into new arrays of v's shape (0-d ones stay arrays); with `wrap`,
    plus (wrap - v)(1 - pp1 / (wrap - 1))(W / v + c) where v < wrap (pp1 is (pp - 1) / vp there)."""
    mean = np.divide(W, v, out=np.empty(v.shape))
    bubble = np.maximum(mean, wmax)
    bubble += c
    bubble *= pp1
    out = np.multiply(v, c, out=np.empty(v.shape))
    np.add(W, out, out=out)
    out += bubble
    if wrap is not None:
        short = np.maximum(np.asarray(wrap) - v, 0.0)
        if short.any():
            mean += c
            mean *= short
            mean *= 1.0 - pp1 / np.maximum(np.asarray(wrap) - 1.0, 1.0)
            out += mean
    return out


@dataclass
class ReplicaSums:
    """Per replica, the sums of its sequences that the estimate reads: cost W, tokens T, count n, largest w_max."""

    W: np.ndarray
    T: np.ndarray
    n: np.ndarray
    wmax: np.ndarray

    @classmethod
    def of(cls, lengths: np.ndarray, w_seq: np.ndarray, replica_of: np.ndarray, R: int) -> ReplicaSums:
        wmax = np.zeros(R)
        np.maximum.at(wmax, replica_of, w_seq)
        return cls(
            np.bincount(replica_of, weights=w_seq, minlength=R),
            np.bincount(replica_of, weights=lengths, minlength=R).astype(np.int64),
            np.bincount(replica_of, minlength=R),
            wmax,
        )


def estimates(
    sums: ReplicaSums, table: ReplicaTable, bias: np.ndarray, rows: np.ndarray | slice = slice(None)
) -> np.ndarray:
    """`estimate_time` of the replicas `rows` from their sums, plus each one's bias."""
    return estimate_time(sums.W[rows], sums.T[rows], sums.n[rows], sums.wmax[rows],
                         *(x[rows] for x in table.params)) + bias[rows]
