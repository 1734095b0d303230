"""Dispatch's local search: move or swap sequences off the bottleneck replica while that lowers it.

Moves and swaps are evaluated for all candidates at once with numpy, on the
estimate of replicas.py; one sequence per distinct length stands for its
equals, so a round costs O(distinct^2), not O(sequences^2).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hydraulis.planner.replicas import BULK_MIN_SEQUENCES, ReplicaSums, ReplicaTable, estimate_time, estimates


def _movable(members: np.ndarray, costs: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A replica's items worth trying to move (one per length class), their costs on it (`costs`: its row),
    and its largest cost without each of them (taken over all its items, before the representatives)."""
    w = costs[members]
    wmax_wo = _without_each(w)
    keep = representatives(lengths[members])
    return members[keep], w[keep], wmax_wo[keep]


def _without_each(w_items: np.ndarray) -> np.ndarray:
    """Largest of the other items, for each item (the replica's w_max once it leaves)."""
    if len(w_items) == 1:
        return np.zeros(1)
    top2 = np.partition(w_items, -2)[-2:]
    first, second = top2.max(), top2.min()
    return np.where(w_items >= first, second, first)


def local_search(
    lengths: np.ndarray,
    table: ReplicaTable,
    replica_of: np.ndarray,
    bias: np.ndarray | None = None,
    max_rounds: int | None = None,
    swap_partners: int = 4,
    rel_tol: float = 1e-4,
    targets_per_config: int = 8,
) -> np.ndarray:
    """Move or swap sequences off the bottleneck replica while that lowers it below its current time.

    After a water-filled greedy (large batches) the bottleneck is within a light
    sequence of the others, so fewer rounds are worth their cost there.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if max_rounds is None:
        max_rounds = 100 if len(lengths) < BULK_MIN_SEQUENCES else 16
    R = len(table)
    bias = np.zeros(R) if bias is None else np.asarray(bias, dtype=np.float64)
    replica_of = replica_of.copy()
    wg = table.cost_matrix(lengths)  # [configs, n]
    group = table.group
    w_own = wg[group[replica_of], np.arange(len(lengths))]
    sums = ReplicaSums.of(lengths, w_own, replica_of, R)
    est = estimates(sums, table, bias)
    search = _Search(lengths=lengths, table=table, bias=bias, wg=wg, replica_of=replica_of, sums=sums, est=est)
    p = table.params
    for _ in range(max_rounds):
        b = int(np.argmax(est))
        top = est[b]
        tol = rel_tol * top
        items = np.flatnonzero(replica_of == b)
        if len(items) == 0:
            break
        items, w_bk, wmax_wo = _movable(items, wg[group[b]], lengths)
        s_k = lengths[items]
        e_b = estimate_time(sums.W[b] - w_bk, sums.T[b] - s_k, sums.n[b] - 1, wmax_wo, *(x[b] for x in p)) + bias[b]
        # Moves: every item of b to each of the least loaded replicas of every config, at once.
        cand = _least_loaded(est, group, targets_per_config)
        w_rk = wg[group[cand]][:, items]  # [candidates, k]
        e_r = (
            estimate_time(
                sums.W[cand, None] + w_rk,
                sums.T[cand, None] + s_k[None, :],
                sums.n[cand, None] + 1,
                np.maximum(sums.wmax[cand, None], w_rk),
                *(x[cand, None] for x in p),
            )
            + bias[cand, None]
        )
        e_r[cand == b] = np.inf
        e_r[table.lone_cap[cand, None] < s_k[None, :]] = np.inf
        worst = np.maximum(e_r, e_b[None, :])
        j, k = np.unravel_index(int(np.argmin(worst)), worst.shape)
        r = int(cand[j])
        if worst[j, k] < top - tol:
            search.move(items[k], b, r)
            search.refresh(b, r)
            continue
        # Swaps: an item of b against an item of one of the least loaded replicas.
        if not _best_swap(search, _Bottleneck(b, items, w_bk, wmax_wo), swap_partners, tol):
            break
    return replica_of


SEARCH_ITEMS = 384  # distinct lengths per replica that a move or swap considers


def representatives(lengths: np.ndarray, limit: int = SEARCH_ITEMS) -> np.ndarray:
    """Positions of one sequence per distinct length (at most `limit`, spread over the range).

    Sequences of equal length are interchangeable in a move or a swap, so one of
    each loses nothing, and the search costs O(distinct^2), not O(sequences^2).
    """
    _, first = np.unique(lengths, return_index=True)
    if len(first) > limit:
        first = first[np.unique(np.linspace(0, len(first) - 1, limit).round().astype(np.int64))]
    return np.sort(first)


def _least_loaded(est: np.ndarray, group: np.ndarray, per_group: int) -> np.ndarray:
    """Indices of the `per_group` least loaded replicas of each config."""
    if len(est) <= per_group * (int(group.max()) + 1):
        return np.arange(len(est))
    out = []
    for g in np.unique(group):
        members = np.flatnonzero(group == g)
        if len(members) > per_group:
            members = members[np.argpartition(est[members], per_group)[:per_group]]
        out.append(members)
    return np.concatenate(out)


@dataclass
class _Search:
    """The local search's working state: the assignment, its per-replica sums and estimates."""

    lengths: np.ndarray  # [sequences]
    table: ReplicaTable
    bias: np.ndarray  # [replicas]
    wg: np.ndarray  # [configs, sequences] the cost of each sequence on each config
    replica_of: np.ndarray  # [sequences], changed in place
    sums: ReplicaSums
    est: np.ndarray  # [replicas] estimated times

    def move(self, i: int, src: int, dst: int) -> None:
        """Sequence i from replica src to dst, with the sums (not the estimates) updated."""
        sums, wg, group, lengths = self.sums, self.wg, self.table.group, self.lengths
        self.replica_of[i] = dst
        sums.W[src] -= wg[group[src], i]
        sums.W[dst] += wg[group[dst], i]
        sums.T[src] -= lengths[i]
        sums.T[dst] += lengths[i]
        sums.n[src] -= 1
        sums.n[dst] += 1
        for r in (src, dst):
            members = np.flatnonzero(self.replica_of == r)
            sums.wmax[r] = wg[group[r], members].max() if len(members) else 0.0

    def refresh(self, *replicas: int) -> None:
        self.est[list(replicas)] = estimates(self.sums, self.table, self.bias, np.array(replicas))


@dataclass(frozen=True)
class _Bottleneck:
    """The slowest replica's candidate sequences, with their costs on it and its w_max without each."""

    replica: int
    items: np.ndarray
    w: np.ndarray
    wmax_without: np.ndarray


def _best_swap(search: _Search, neck: _Bottleneck, partners: int, tol: float) -> bool:
    """Swap a bottleneck sequence with one of a least loaded replica's, if that lowers the bottleneck."""
    sums, table, bias, est, lengths, wg = search.sums, search.table, search.bias, search.est, search.lengths, search.wg
    b, items, w_bk, wmax_wo = neck.replica, neck.items, neck.w, neck.wmax_without
    group = table.group
    top = est[b]
    order = np.argsort(est)
    for r in order[:partners].tolist():
        if r == b:
            continue
        mine = np.flatnonzero(search.replica_of == r)
        if len(mine) == 0:
            continue
        mine, w_rm, wmax_wo_r = _movable(mine, wg[group[r]], lengths)
        s_k, s_m = lengths[items], lengths[mine]
        w_bm = wg[group[b], mine]  # r's items costed on b
        w_rk = wg[group[r], items]  # b's items costed on r
        fits_b = table.lone_cap[b] >= s_m
        fits_r = table.lone_cap[r] >= s_k
        pb = [x[b] for x in table.params]
        pr = [x[r] for x in table.params]
        e_b = (
            estimate_time(
                sums.W[b] - w_bk[:, None] + w_bm[None, :],
                sums.T[b] - s_k[:, None] + s_m[None, :],
                sums.n[b],
                np.maximum(wmax_wo[:, None], w_bm[None, :]),
                *pb,
            )
            + bias[b]
        )
        # A swap pays only where both replicas end below the bottleneck's time: r's estimate is needed only
        # where b's already is (about 2 pairs in 5 on the bench's batches, and both in 1 in 50,000). The first
        # least pair (row-major) among those is the first least of the whole matrix; costs are finite, so no
        # estimate is NaN.
        kk, mm = np.nonzero((e_b < top - tol) & fits_r[:, None] & fits_b[None, :])
        if len(kk) == 0:
            continue
        e_r = (
            estimate_time(
                sums.W[r] - w_rm[mm] + w_rk[kk],
                sums.T[r] - s_m[mm] + s_k[kk],
                sums.n[r],
                np.maximum(wmax_wo_r[mm], w_rk[kk]),
                *pr,
            )
            + bias[r]
        )
        worst = np.maximum(e_b[kk, mm], e_r)
        j = int(np.argmin(worst))
        if worst[j] < top - tol:
            search.move(items[kk[j]], b, r)
            search.move(mine[mm[j]], r, b)
            search.refresh(b, r)
            return True
    return False
