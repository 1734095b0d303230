"""The exchange plan between the owner shards and one deployment, in bounded rounds.

Rank o owns chunk o of every stripe of the global vector (layout.py). The
exchange runs in rounds, stripe by stripe, so in model order: round k of a
stripe moves, for EVERY owner at once, the window [lo_o + kW, lo_o + (k+1)W)
of its chunk of that stripe (consecutive stripes whose chunks fit one
window share a round). A rank's gather (or reduce) ranges are
disjoint, so in one round it sends at most W elements to each owner its
shard touches and an owner receives at most W elements from each rank whose
shard touches it. With W = half a bucket / the largest such fan-out, every
round's send buffer and receive buffer each hold at most half a bucket,
whatever the model size or the number of replicas, so two rounds in flight
(one computing layers hide, the next prefetched: exchange.py) hold at most
two buckets; the owner sums a round's contributions as they arrive
(Megatron's bucketed reduce-scatter and core/resharding's cached transfer
plans, applied to heterogeneous layouts). Each round is one
`all_to_all_single` with split sizes, which gloo and NCCL both have.

Plans hold element counts and offsets only; they are computed once per
deployment from range intersections and cached by the optimizer.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from hydraulis.cost.memory import EXCHANGE_ELEMENT_BYTES  # rounds are sized for fp32, the widest it moves
from hydraulis.errors import HydraulisError
from hydraulis.limits import DEFAULT_EXCHANGE_BUCKET_BYTES
from hydraulis.parallel import Deployment
from hydraulis.runtime.optimizer.layout import LocalParam, Role, ShardLayout
from hydraulis.runtime.parallelism.groups import rank_roles

EXCHANGE_WINDOW = "hydraulis.exchange"  # the profiler range of every exchange call (memory_meter.PeakMeter)


def deployment_roles(deployment: Deployment, sequence_parallel: bool = False) -> dict[int, Role]:
    """Every global rank's role in a deployment (ranks are stage-major within a replica, as groups.py builds them).

    The CP ranks of a TP rank share its role: the same parameter shard, each
    with the gradient of its own tokens, which the owners sum as they sum replicas.
    """
    roles = {}
    for replica in deployment.replicas:
        config = replica.config
        for rank, (stage, _, tp_rank) in rank_roles(config, replica.devices).items():
            roles[rank] = Role(config, stage, tp_rank, sequence_parallel and config.tp > 1)
    return roles


def _clip(ranges: np.ndarray, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
    """(k, 2) ranges intersected with [lo, hi), empty ones dropped, and the indices of those kept."""
    if len(ranges) == 0 or hi <= lo:
        return ranges[:0], np.zeros(0, np.int64)
    out = np.stack([np.maximum(ranges[:, 0], lo), np.minimum(ranges[:, 1], hi)], axis=1)
    keep = np.nonzero(out[:, 1] > out[:, 0])[0]
    return out[keep], keep


def _fan_out(ranges: dict[int, np.ndarray], bounds: np.ndarray) -> int:
    """The most owners one rank's ranges touch, or ranks one owner's range is touched by."""
    world = len(bounds) - 1
    touches = np.zeros((world, world), dtype=bool)  # [rank, owner]
    for r, rr in ranges.items():
        for o in range(world):
            touches[r, o] = len(_clip(rr, int(bounds[o]), int(bounds[o + 1]))[0]) > 0
    return int(max(touches.sum(axis=1).max(), touches.sum(axis=0).max(), 1))


@dataclass(frozen=True)
class ExchangeRound:
    """One all_to_all_single of the gather and one of the reduce (element counts per peer, in rank order).

    gather_send: (owned offset, length) copied from the master, peer by peer;
    gather_recv: (local parameter index, canonical offset, length) written into the compute shard;
    reduce_send: (local parameter index, canonical offset, length) read from the gradients;
    reduce_recv: (owned offset, length) summed into the owned gradient, in buffer order.
    """

    gather_send: tuple[tuple[int, int], ...]
    gather_send_splits: tuple[int, ...]
    gather_recv: tuple[tuple[int, int, int], ...]
    gather_recv_splits: tuple[int, ...]
    reduce_send: tuple[tuple[int, int, int], ...]
    reduce_send_splits: tuple[int, ...]
    reduce_recv: tuple[tuple[int, int], ...]
    reduce_recv_splits: tuple[int, ...]
    stripe: int = 0  # the first stripe the round moves


@dataclass(frozen=True)
class ExchangePlan:
    """One rank's side of the gather and the reduce for one deployment, as rounds of at most one bucket each."""

    rank: int
    local: tuple[LocalParam, ...]
    window: int  # owned elements per owner per round
    rounds: tuple[ExchangeRound, ...]
    # Per local parameter, the last round that brings any rank of this rank's stage (TP and CP peers) its
    # values of it (-1: none): the round a layer waits for before it computes (exchange.py).
    gather_needs: tuple[int, ...] = ()

    @classmethod
    def build(
        cls,
        layout: ShardLayout,
        deployment: Deployment,
        rank: int,
        sequence_parallel: bool = False,
        bucket_bytes: int = DEFAULT_EXCHANGE_BUCKET_BYTES,
    ) -> ExchangePlan:
        """Size the window, cut the stripes into rounds, then list this rank's pieces of each round."""
        roles = deployment_roles(deployment, sequence_parallel)
        world = layout.world_size
        if sorted(roles) != list(range(world)):
            raise HydraulisError(f"deployment {deployment} covers ranks {sorted(roles)}, the job has {world}")
        locals_ = {r: layout.local_params(roles[r]) for r in range(world)}
        gathers = {r: np.array([p.gather for p in lp], np.int64).reshape(-1, 2) for r, lp in locals_.items()}
        reduces = {r: np.array([p.reduce for p in lp], np.int64).reshape(-1, 2) for r, lp in locals_.items()}
        fan = max(
            max(_fan_out(gathers, layout.bounds[s]), _fan_out(reduces, layout.bounds[s])) for s in range(layout.stripes)
        )
        window = max(1, bucket_bytes // 2 // EXCHANGE_ELEMENT_BYTES // fan)
        by_round = _round_windows(layout, window)
        local = locals_[rank]
        base = np.array([p.gather[0] for p in local], np.int64)
        rounds = tuple(_round(layout, rank=rank, parts=parts, gathers=gathers, reduces=reduces, base=base)
                       for parts in by_round)
        needs = _gather_needs(deployment, rank, by_round, locals_)
        return cls(rank=rank, local=local, window=window, rounds=rounds, gather_needs=needs)

    @functools.cached_property
    def reduce_reads(self) -> tuple[frozenset[int], ...]:
        """Per round, the local parameters whose gradients its reduce sends."""
        return tuple(frozenset(i for i, _, _ in rnd.reduce_send) for rnd in self.rounds)

    def _total(self, field: str) -> tuple[int, ...]:
        return tuple(int(x) for x in np.sum([getattr(r, field) for r in self.rounds], axis=0))

    @property
    def gather_send_splits(self) -> tuple[int, ...]:
        """Elements sent to each peer over all rounds."""
        return self._total("gather_send_splits")

    @property
    def gather_recv_splits(self) -> tuple[int, ...]:
        return self._total("gather_recv_splits")

    @property
    def reduce_send_splits(self) -> tuple[int, ...]:
        return self._total("reduce_send_splits")

    @property
    def reduce_recv_splits(self) -> tuple[int, ...]:
        return self._total("reduce_recv_splits")

    @property
    def largest_buffer(self) -> int:
        """The most elements one send or receive buffer of any round holds on this rank."""
        return max(
            max(sum(r.gather_send_splits), sum(r.gather_recv_splits), sum(r.reduce_send_splits),
                sum(r.reduce_recv_splits))
            for r in self.rounds
        )

    def traffic(self) -> dict[str, int]:
        """Elements this rank sends and receives over the network (its own range to itself excluded)."""
        me = self.rank

        def off_self(splits: tuple[int, ...]) -> int:
            return sum(splits) - splits[me]

        return {
            "gather_send": off_self(self.gather_send_splits),
            "gather_recv": off_self(self.gather_recv_splits),
            "reduce_send": off_self(self.reduce_send_splits),
            "reduce_recv": off_self(self.reduce_recv_splits),
        }

# One round's windows: (stripe, every owner's window of that stripe in global coordinates), per stripe it moves.
_RoundWindows = list[tuple[int, list[tuple[int, int]]]]


def _stripe_windows(layout: ShardLayout, stripe: int, k: int, window: int) -> list[tuple[int, int]]:
    """Window k of every owner's chunk of a stripe, in global coordinates."""
    bounds = layout.bounds[stripe]
    return [(min(int(bounds[o]) + k * window, int(bounds[o + 1])),
             min(int(bounds[o]) + (k + 1) * window, int(bounds[o + 1]))) for o in range(layout.world_size)]


def _round_windows(layout: ShardLayout, window: int) -> list[_RoundWindows]:
    """Rounds in model order: a stripe whose chunks exceed the window takes several rounds; consecutive
    stripes whose chunks together fit one window share a round (few collectives for small models)."""
    by_round: list[_RoundWindows] = []
    group: _RoundWindows = []
    held = 0
    for stripe in range(layout.stripes):
        longest = int(np.diff(layout.bounds[stripe]).max())
        if group and held + longest > window:
            by_round.append(group)
            group, held = [], 0
        if longest <= window:
            group.append((stripe, _stripe_windows(layout, stripe, 0, window)))
            held += longest
        else:
            rounds = -(-longest // window)
            by_round.extend([(stripe, _stripe_windows(layout, stripe, k, window))] for k in range(rounds))
    if group:
        by_round.append(group)
    return by_round


def _round(
    layout: ShardLayout,
    rank: int,
    parts: _RoundWindows,
    gathers: dict[int, np.ndarray],
    reduces: dict[int, np.ndarray],
    base: np.ndarray,
) -> ExchangeRound:
    """This rank's side of one round: as an owner (what each peer needs of, or adds to, its windows),
    and as a peer (what it needs of, or adds to, each owner's windows)."""
    world = layout.world_size
    g_send, g_send_n, r_recv, r_recv_n = [], [], [], []
    for r in range(world):
        n_gather = n_reduce = 0
        for stripe, wins in parts:
            lo_me = int(layout.bounds[stripe, rank]) - int(layout.local_starts[stripe, rank])
            clipped, _ = _clip(gathers[r], *wins[rank])
            g_send.extend((int(a) - lo_me, int(b - a)) for a, b in clipped)
            n_gather += int((clipped[:, 1] - clipped[:, 0]).sum())
            clipped, _ = _clip(reduces[r], *wins[rank])
            r_recv.extend((int(a) - lo_me, int(b - a)) for a, b in clipped)
            n_reduce += int((clipped[:, 1] - clipped[:, 0]).sum())
        g_send_n.append(n_gather)
        r_recv_n.append(n_reduce)
    g_recv, g_recv_n, r_send, r_send_n = [], [], [], []
    for o in range(world):
        n_gather = n_reduce = 0
        for _, wins in parts:
            clipped, idx = _clip(gathers[rank], *wins[o])
            g_recv.extend((int(i), int(a - base[i]), int(b - a)) for i, (a, b) in zip(idx, clipped, strict=True))
            n_gather += int((clipped[:, 1] - clipped[:, 0]).sum())
            clipped, idx = _clip(reduces[rank], *wins[o])
            r_send.extend((int(i), int(a - base[i]), int(b - a)) for i, (a, b) in zip(idx, clipped, strict=True))
            n_reduce += int((clipped[:, 1] - clipped[:, 0]).sum())
        g_recv_n.append(n_gather)
        r_send_n.append(n_reduce)
    return ExchangeRound(
        gather_send=tuple(g_send), gather_send_splits=tuple(g_send_n), gather_recv=tuple(g_recv),
        gather_recv_splits=tuple(g_recv_n), reduce_send=tuple(r_send), reduce_send_splits=tuple(r_send_n),
        reduce_recv=tuple(r_recv), reduce_recv_splits=tuple(r_recv_n), stripe=parts[0][0],
    )


def _gather_needs(
    deployment: Deployment, rank: int, by_round: list[_RoundWindows], locals_: dict[int, tuple[LocalParam, ...]]
) -> tuple[int, ...]:
    """Per local parameter, the last round that brings any rank of this rank's stage its values (-1: none).

    The ranks that compute this rank's stage with it (its TP and CP groups) wait for each other inside a
    layer, so a layer asks for the rounds ANY of them needs: every one has issued them before it blocks.
    """
    replica = next(r for r in deployment.replicas if rank in r.devices)
    roles = rank_roles(replica.config, replica.devices)
    peers = [r for r, role in roles.items() if role[0] == roles[rank][0]]
    world = len(locals_)
    widest = max(len(parts) for parts in by_round) * world
    wins = np.zeros((len(by_round), widest, 2), np.int64)  # every round's windows, empty ones (0, 0) after
    for j, parts in enumerate(by_round):
        flat = [w for _, ws in parts for w in ws]
        wins[j, : len(flat)] = flat
    local = locals_[rank]
    needs = np.full(len(local), -1, np.int64)
    for r in peers:
        by_name = {p.name: p.gather for p in locals_[r]}
        ranges = np.array([by_name[p.name] for p in local], np.int64).reshape(-1, 2)
        hits = ((ranges[:, None, None, 0] < wins[None, :, :, 1]) & (wins[None, :, :, 0] < ranges[:, None, None, 1])
                & (wins[None, :, :, 0] < wins[None, :, :, 1])).any(axis=2)  # [param, round]
        last = np.where(hits.any(axis=1), hits.shape[1] - 1 - np.argmax(hits[:, ::-1], axis=1), -1)
        needs = np.maximum(needs, last)
    return tuple(int(n) for n in needs)
