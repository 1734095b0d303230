"""Stage 2: pack one replica's sequences into micro-batches and order them.

pp = 1: the replica's time is sum(t) = W + v*c, so the fewest micro-batches
win: first-fit decreasing by tokens under the cap.

pp > 1: 1F1B adds (pp - 1) x the largest micro-batch, so more micro-batches
shrink the bubble but each adds c. Around v* = sqrt((pp-1) W / c) (within the
cap's minimum and the busy threshold: no micro-batch below min_efficient_tokens
when the replica has tokens to spare) we balance cost with LPT under the token
cap, keep the v with the best closed form, then pick the execution order by
simulation: the first micro-batch sets the warm-up and the last the cool-down,
so small ones belong at the ends. `ramp_bins` adds packings with a few small
micro-batches of the shortest sequences made for those ends.

With memory policies per micro-batch (replicas.py), a sequence beyond the cap but within a policy's runs
as its own micro-batch under that policy, beside the others packed as above.

A replica's lone micro-batch may hold up to its lone cap (a deep replica keeps it in flight once, not
pp times): a replica given a sequence longer than its cap runs everything it holds as that one
micro-batch, and a pp = 1 replica whose sequences fit one takes one (the fewest c).
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass

import numpy as np

from hydraulis.cost.model import CostModel
from hydraulis.errors import HydraulisError
from hydraulis.planner.order_search import fastest_order
from hydraulis.planner.replicas import HEAVY_SHARE, ReplicaCost, micro_batch_range
from hydraulis.planner.sim import closed_form_replica_time, simulate_replica


@dataclass(frozen=True)
class Packing:
    micro_batches: tuple[np.ndarray, ...]  # sequence indices (of the batch), in execution order
    time_s: float  # simulated 1F1B time of the replica


def check_cap(lengths: np.ndarray, cap: int) -> None:
    """A sequence longer than the micro-batch cap cannot be packed: say so."""
    if len(lengths) and int(np.max(lengths)) > cap:
        raise HydraulisError(
            f"a sequence of {int(np.max(lengths))} tokens is longer than the micro-batch cap of {cap} tokens"
        )


def first_fit_decreasing(lengths: np.ndarray, cap: int) -> list[list[int]]:
    """Positions into `lengths`, packed by tokens into as few bins of `cap` as FFD finds.

    Equal lengths go in runs: first fit puts a run's items into the earliest bins
    with room, floor(room / s) each, so a run costs one pass over the bins, not
    one per item (100K short sequences are a few hundred runs).
    """
    return first_fit_without_shortest(lengths, cap, [0])[0]


def first_fit_without_shortest(lengths: np.ndarray, cap: int, drops: list[int]) -> list[list[list[int]]]:
    """`first_fit_decreasing` of `lengths` without its k shortest (by length, then position: the first k of a
    stable ascending sort), for each k of `drops`, as positions into `lengths`, in one pass.

    First fit places items one after another in decreasing order (ties by position), so without the shortest
    it is the same pass stopped early: the longer runs as they were, then what is left of the run where the
    dropped ones begin (its later positions: an ascending sort drops a run's first ones) from the bins as they
    stood before that run.
    """
    check_cap(lengths, cap)
    lengths = np.asarray(lengths, dtype=np.int64)
    order = np.argsort(-lengths, kind="stable")
    sorted_lengths = lengths[order]
    starts = np.flatnonzero(np.r_[True, sorted_lengths[1:] != sorted_lengths[:-1]]).tolist()
    ends = [*starts[1:], len(order)]
    order_l, sorted_l = order.tolist(), sorted_lengths.tolist()
    n = len(order_l)
    out: list[list[list[int]] | None] = [None] * len(drops)
    fit = _FirstFit(cap)
    for a, e in zip(starts, ends, strict=True):
        for q, k in enumerate(drops):
            if out[q] is None and n - k < e:  # this run loses its first max(0, e - (n - k)) items
                early = fit.copy()
                if n - k > a:
                    early.place(order_l[a + e - (n - k) : e], sorted_l[a])
                out[q] = early.bins
        fit.place(order_l[a:e], sorted_l[a])
    return [fit.bins if b is None else b for b in out]


FIRST_FIT_SCAN = 256  # bins a plain scan serves: faster than numpy calls up to a few hundred (1.3-2.5x at 56-235)


class _FirstFit:
    """First fit's bins (positions) and rooms. While there are few bins a plain scan beats numpy's per-call
    cost; past FIRST_FIT_SCAN the rooms move to an array."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.bins: list[list[int]] = []
        self.room_l: list[int] = []
        self.rooms = np.zeros(0, dtype=np.int64)

    def copy(self) -> _FirstFit:
        other = _FirstFit(self.cap)
        other.bins = [b.copy() for b in self.bins]
        other.room_l = self.room_l.copy()
        other.rooms = self.rooms.copy()
        return other

    def place(self, items: list[int], s: int) -> None:
        """A run of items of `s` tokens each, in order: each bin with room takes floor(room / s) of them,
        the earliest first; the rest open new bins of cap // s each."""
        bins, room_l, cap, m = self.bins, self.room_l, self.cap, len(items)
        used = 0
        if len(room_l) <= FIRST_FIT_SCAN:
            for j, room in enumerate(room_l):
                if room >= s:
                    k = min(room // s, m - used)
                    bins[j].extend(items[used : used + k])
                    room_l[j] -= k * s
                    used += k
                    if used == m:
                        break
            if used < m:
                per_bin = cap // s
                for i in range(used, m, per_bin):
                    chunk = items[i : min(i + per_bin, m)]
                    bins.append(chunk)
                    room_l.append(cap - s * len(chunk))
            if len(room_l) > FIRST_FIT_SCAN:
                self.rooms = np.array(room_l, dtype=np.int64)
            return
        rooms = self.rooms
        take = np.minimum(rooms // s, m)
        if take.any():
            cum = np.cumsum(take)
            last = int(np.searchsorted(cum, m))  # bins 0..last take items (the last one perhaps fewer)
            take = take.copy()
            if last < len(take):
                take[last] = m - (int(cum[last - 1]) if last else 0)
                take[last + 1 :] = 0
            for j in np.flatnonzero(take).tolist():
                k = int(take[j])
                bins[j].extend(items[used : used + k])
                rooms[j] -= k * s
                used += k
        if used < m:
            per_bin = cap // s
            rest = items[used:]
            new_bins = [rest[i : i + per_bin] for i in range(0, len(rest), per_bin)]
            bins.extend(new_bins)
            self.rooms = np.concatenate([rooms, np.array([cap - s * len(b) for b in new_bins], dtype=np.int64)])


BULK_PACK_ITEMS = 2048  # a replica with more sequences packs its light tail in chunks


def balanced_bins(
    lengths: np.ndarray, costs: np.ndarray, cap: int, v: int, bulk: bool = False
) -> list[list[int]] | None:
    """LPT by cost into exactly v bins under the token cap; None if a sequence finds no room.

    `bulk` (or many sequences): only the heavy head goes one at a time; the light tail goes v at a time,
    the next v by cost to the v least loaded bins, so Python steps number about n / v. If a chunk meets
    a full bin, the exact LPT decides.
    """
    order = np.argsort(-costs, kind="stable")
    head = len(order)
    if bulk or len(order) >= BULK_PACK_ITEMS:
        w_sorted = np.asarray(costs, dtype=np.float64)[order]
        head = int(np.searchsorted(-w_sorted, -float(w_sorted.sum()) / v * HEAVY_SHARE, side="left"))
    heap = [(0.0, j) for j in range(v)]
    rooms = [cap] * v
    bins: list[list[int]] = [[] for _ in range(v)]
    L = lengths.tolist()
    w = costs.tolist()
    for k in order[:head].tolist():
        s = L[k]
        skipped = []
        while heap:
            load, j = heapq.heappop(heap)
            if rooms[j] >= s:
                break
            skipped.append((load, j))
        else:
            return None
        rooms[j] -= s
        bins[j].append(k)
        heapq.heappush(heap, (load + w[k], j))
        for item in skipped:
            heapq.heappush(heap, item)
    if head < len(order):
        tail = _fill_tail(order[head:], np.asarray(lengths), np.asarray(costs, dtype=np.float64), heap, rooms)
        if tail is None:
            return balanced_bins(lengths, costs, cap, v, bulk=False) if len(order) < BULK_PACK_ITEMS else None
        for j, items in enumerate(tail):
            bins[j].extend(items)
    if any(not b for b in bins):
        return None
    return bins


def _fill_tail(
    tail: np.ndarray, lengths: np.ndarray, costs: np.ndarray, heap: list[tuple[float, int]], room: list[int]
) -> list[list[int]] | None:
    """The light tail, v at a time, onto bins with these loads (heap) and rooms; None if one has no room."""
    v = len(room)
    loads = np.zeros(v)
    for load, j in heap:
        loads[j] = load
    rooms = np.array(room, dtype=np.int64)
    assign = np.empty(len(tail), dtype=np.int64)
    for start in range(0, len(tail), v):
        chunk = tail[start : start + v]
        targets = np.argsort(loads, kind="stable")[: len(chunk)]
        if (rooms[targets] < lengths[chunk]).any():
            return None
        assign[start : start + v] = targets
        loads[targets] += costs[chunk]
        rooms[targets] -= lengths[chunk]
    by_bin = np.argsort(assign, kind="stable")
    counts = np.bincount(assign, minlength=v)
    return [tail[b].tolist() for b in np.split(by_bin, np.cumsum(counts)[:-1])]


def execution_orders(times: np.ndarray) -> list[np.ndarray]:
    """Candidate orders of micro-batches with these stage times (positions)."""
    v = len(times)
    desc = np.argsort(-times, kind="stable")
    asc = desc[::-1]
    if v < 3:
        return [desc, asc]
    ends = np.concatenate([asc[:1], asc[2:], asc[1:2]])  # smallest first, second smallest last
    middle = np.concatenate([asc[:1], desc[:-2], asc[1:2]])
    pyramid = np.concatenate([asc[0::2], asc[1::2][::-1]])  # ramp up, then down
    return [desc, asc, ends, middle, pyramid]


def packing_orders(times: np.ndarray, ramped: bool, bulk: bool) -> list[np.ndarray]:
    """The execution orders a pipelined packing is tried in: one of `ramp_bins` ascending and as a pyramid only (the
    orders that win there), many light micro-batches (`bulk`) those with small ones at the ends."""
    orders = execution_orders(times)
    return orders[1::3] if ramped else orders[2:] if bulk else orders


def order_by_simulation(micro_batches: list[np.ndarray], lengths: np.ndarray, replica: ReplicaCost, cost: CostModel,
                        bulk: bool = False, ramped: bool = False) -> Packing:
    """Put the micro-batches in the order whose simulated 1F1B time is least (`ramped`: of `ramp_bins`)."""
    return fastest_packing([(micro_batches, ramped)], np.asarray(lengths), replica, cost, bulk)


def fastest_packing(
    candidates: list[tuple[list[np.ndarray], bool]], lengths: np.ndarray, replica: ReplicaCost, cost: CostModel,
    bulk: bool = False, beat: float = np.inf,
) -> Packing:
    """The least simulated time over candidate packings (micro-batches, ramped) in their execution orders; of
    equal times the first packing's first order, as simulating each in turn would choose. Where that time is
    above `beat`, a packing said to take more than `beat` (inf, or its time): a caller that wants less learns so
    sooner. Pipelines search by bounded simulations (`order_search.fastest_order`); one stage's time is its sum.
    """
    prepared = []  # (micro-batches, stage times, p2p times, orders)
    for mbs, ramped in candidates:
        if not mbs:
            return Packing((), 0.0)
        tokens, times = stage_times(mbs, lengths, replica, cost)
        comm = np.array([cost.p2p_time(replica.config, t) for t in tokens.tolist()])
        orders = [np.arange(len(mbs))] if replica.pp == 1 else packing_orders(times, ramped, bulk or sum(
            len(mb) for mb in mbs) >= BULK_PACK_ITEMS)
        prepared.append((mbs, times, comm, orders))
    if replica.pp > 1 and not any(p[3] for p in prepared):  # every packing under 3 micro-batches, bulk: no ends
        prepared = [(mbs, times, comm, execution_orders(times)) for mbs, times, comm, _ in prepared]
    if replica.pp == 1:
        t, k, o = min((simulate_replica(times, 1, comm, keep_events=False).time_s, k, 0)
                      for k, (_, times, comm, _) in enumerate(prepared))
    else:
        t, k, o = fastest_order([p[1:] for p in prepared], replica.pp, replica.config.vp, beat)
    mbs = prepared[k][0]
    return Packing(tuple(mbs[j] for j in prepared[k][3][o].tolist()), t)


EXACT_SQUARES = 1 << 26  # tokens of a micro-batch below which its sum of squares is an exact float64


def stage_times(
    micro_batches: list[np.ndarray], lengths: np.ndarray, replica: ReplicaCost, cost: CostModel
) -> tuple[np.ndarray, np.ndarray]:
    """Tokens and stage time of each micro-batch, each under its memory policy (`ReplicaCost.policy`): what
    `CostModel.stage_time` gives one at a time, in one pass (the sums of squares are exact integers, so the
    float arithmetic is the same)."""
    sizes = np.fromiter((len(mb) for mb in micro_batches), dtype=np.int64, count=len(micro_batches))
    s = np.asarray(lengths, dtype=np.int64)[np.concatenate(micro_batches).astype(np.int64)]
    ends = np.cumsum(sizes)
    # Prefix sums, exact in int64: an empty micro-batch sums to 0 (reduceat would give the next element).
    tokens = np.diff(np.r_[0, np.cumsum(s)][np.r_[0, ends]])
    count = len(micro_batches)
    if int(tokens.max(initial=0)) >= EXACT_SQUARES:
        times = [cost.stage_time(replica.config, lengths[mb], replica.policy(int(t), count))
                 for mb, t in zip(micro_batches, tokens, strict=True)]
        return tokens, np.array(times)
    squares = np.diff(np.r_[0, np.cumsum(s * s)][np.r_[0, ends]]).astype(np.float64)
    # Each micro-batch's policy: that of the first step whose limit holds it, else the plain one (`ReplicaCost.steps`).
    limits, policies = replica.steps(count)
    held = tokens[:, None] <= limits[None, :]
    step = np.where(held.any(axis=1), held.argmax(axis=1), len(limits))
    sa, sb = np.array([cost.policy_scale(replica.config, p) for p in (*policies, None)]).T[:, step]
    i = cost.index(replica.config)
    return tokens, sa * cost.a[i] * squares + sb * cost.b[i] * tokens.astype(np.float64) + cost.c[i]


def pack_replica(
    indices: np.ndarray, lengths: np.ndarray, replica: ReplicaCost, cost: CostModel, bulk: bool = False,
    beat: float = np.inf,
) -> Packing:
    """Micro-batches (of batch indices) for the sequences `indices` on `replica`, ordered (`fastest_packing`: a
    time of `beat` or more where none is less).

    `bulk` (a large batch of light sequences, or a replica with many): the closed form ranks packings
    as the simulation would, so fewer are built and only the best is simulated, in two orders.

    Where the caps follow the count (`ReplicaCost.at_count`: interleaved, with a policy per micro-batch), the
    packing's count M is known once packed: packed again at M's own caps, above those of every count to the
    horizon, each packing kept only where its own count holds every micro-batch (`ReplicaCost.fits`).
    """
    indices = np.asarray(indices, dtype=np.int64)
    if len(indices) == 0:
        return Packing((), 0.0)
    lengths = np.asarray(lengths)
    candidates, bulk = packing_candidates(indices, lengths, replica, bulk)
    found = fastest_packing(candidates=candidates, lengths=lengths, replica=replica, cost=cost, bulk=bulk, beat=beat)
    for _ in range(COUNT_ROUNDS):  # packings again at the count the last one came to
        at = replica.at_count(len(found.micro_batches)) if found.micro_batches else None
        again = [c for c in packing_candidates(indices, lengths, at, bulk)[0] if replica.fits(c[0], lengths)] if (
            at is not None and at.cap > replica.cap) else []
        other = fastest_packing(candidates=again, lengths=lengths, replica=replica, cost=cost, bulk=bulk,
                                beat=min(beat, found.time_s)) if again else found
        if other.time_s >= found.time_s or len(other.micro_batches) == len(found.micro_batches):
            return min(found, other, key=lambda p: p.time_s)
        found = other
    return found


COUNT_ROUNDS = 2


def packing_candidates(
    indices: np.ndarray, lengths: np.ndarray, replica: ReplicaCost, bulk: bool
) -> tuple[list[tuple[list[np.ndarray], bool]], bool]:
    """`pack_replica`'s candidate packings (micro-batches, ramped) of `indices` on `replica`'s caps, and whether
    the closed form ranks them (`bulk`)."""
    s = np.asarray(lengths, dtype=np.int64)[indices]
    tokens = int(s.sum())
    if int(s.max()) > replica.reach or (replica.pp == 1 and tokens <= replica.plain_lone):
        if tokens > replica.holds:  # dispatch keeps a replica holding a long sequence within its lone cap
            check_cap(s, replica.cap)
            raise HydraulisError(
                f"{replica.config.name}: a sequence longer than the cap of {replica.cap} tokens runs as the "
                f"replica's lone micro-batch, of at most {replica.holds} tokens, but it holds {tokens}"
            )
        return [([indices], False)], bulk
    # With many sequences the closed form ranks packings as the simulation would: simulate only the best.
    bulk = bulk or len(s) >= BULK_PACK_ITEMS
    alone = s > replica.cap  # within a memory policy's cap: each its own micro-batch under it
    singles, rest, s = [indices[[k]] for k in np.flatnonzero(alone)], indices[~alone], s[~alone]
    ffd, ramps = first_fits(s, replica) if len(s) else ([], [])
    chosen = choose_bins(s, replica, bulk, ffd)[: 1 if bulk else SIMULATED_PACKINGS] if len(s) else []
    candidates = [(bins, False) for bins in chosen] + [(bins, True) for bins in ramps]
    if singles and tokens <= replica.plain_lone:  # or all of it as one plain lone micro-batch, no recompute
        candidates.append((None, False))
    return [([indices] if bins is None else [rest[b] for b in bins] + singles, ramped)
            for bins, ramped in candidates or [([], False)]], bulk


SIMULATED_PACKINGS = 3  # the closed form ranks packings; this many of the best are simulated


def choose_bins(
    s: np.ndarray, replica: ReplicaCost, bulk: bool = False, ffd: list[np.ndarray] | None = None
) -> list[list[np.ndarray]]:
    """Candidate packings (positions into `s` per micro-batch), best closed-form 1F1B time first (`ffd`: `s`'s
    first-fit decreasing, where the caller has it)."""
    if ffd is None:
        ffd = [np.array(b, dtype=np.int64) for b in first_fit_decreasing(s, replica.cap)]
    if replica.pp == 1 or len(s) == 1:
        return [ffd]
    w = replica.seq_costs(s)
    W, T, n = float(w.sum()), int(s.sum()), len(s)
    pp1 = replica.bubble_stages  # pp - 1, interleaved (pp - 1) / vp
    vmin, vmax = (int(x) for x in micro_batch_range(T, n, replica.cap, replica.min_efficient))
    vstar = math.floor(math.sqrt(pp1 * W / max(replica.c, 1e-12)))
    tries = (vstar, vstar + 1) if bulk or len(s) >= BULK_PACK_ITEMS else (vstar - 1, vstar, vstar + 1, vstar + 2, vmin)
    candidates = sorted({min(max(v, vmin), vmax) for v in tries})

    def closed(bins: list[np.ndarray]) -> float:
        return closed_form_replica_time([w[b].sum() + replica.c for b in bins], replica.pp, replica.config.vp)

    if replica.config.vp > 1 and replica.cap_at(2 * replica.pp) > replica.cap:
        # interleaved, counts whose group is pp hold more per micro-batch (ReplicaCost.cap_at): where the cap binds
        # the count, the least such count at its cap (fewer micro-batches, less c), and the next
        pp = replica.pp
        fewest = -(-T // replica.cap_at(2 * pp))  # micro-batches at that cap
        least = max(2, -(-fewest // pp)) * pp
        candidates = sorted({*candidates, *(v for v in (least, least + pp) if v < vmin and v <= n)})
    ranked = [(closed(ffd), 0, ffd)]
    for v in candidates:
        found = balanced_bins(s, w, replica.cap_at(v), v, bulk)
        if found is not None:
            bins = [np.array(b, dtype=np.int64) for b in found]
            ranked.append((closed(bins), len(ranked), bins))
    return [bins for _, _, bins in sorted(ranked, key=lambda x: x[:2])]


RAMPS = ((1 / 2,), (1 / 8, 1 / 2))  # token budgets (of the cap) of the small micro-batches, smallest first


def ramp_bins(s: np.ndarray, replica: ReplicaCost) -> list[list[np.ndarray]]:
    """Packings with a few small micro-batches of the shortest sequences (one or two per budget of a ramp),
    the rest first-fit decreasing.

    1F1B on pp stages waits (pp - 1) forwards of the first micro-batch in the warm-up and (pp - 1) backwards of
    the last in the cool-down, and a stage idles where a micro-batch outgrows the one before: ordered as a
    pyramid, small micro-batches at the ends shorten the bubble. Each extra one costs c, and the simulation
    weighs the two (on the bench's llama-32b pp2 and pp4 replicas: 0.6-1.4% of a replica's time).
    """
    return first_fits(s, replica)[1]


def first_fits(s: np.ndarray, replica: ReplicaCost) -> tuple[list[np.ndarray], list[list[np.ndarray]]]:
    """`s`'s first-fit decreasing and, pipelined (pp > 1), `ramp_bins`'s packings: the rests of every ramp (the
    batch without its shortest) and the whole from one first-fit pass."""
    order = np.argsort(s, kind="stable")
    ramps = []
    for ramp, copies in itertools.product(RAMPS, (1, 2)) if replica.pp > 1 else ():
        pos, small = 0, []
        for share in ramp:
            for _ in range(copies):
                take = int(np.searchsorted(np.cumsum(s[order[pos:]]), int(replica.cap * share), side="right"))
                if take:
                    small.append(order[pos : pos + take])
                    pos += take
        if pos < len(s) and small:
            ramps.append((small, pos))
    whole, *rests = first_fit_without_shortest(s, replica.cap, [0] + [pos for _, pos in ramps])
    return [np.array(b, dtype=np.int64) for b in whole], [
        small + [np.array(b, dtype=np.int64) for b in bins] for (small, _), bins in zip(ramps, rests, strict=True)]
