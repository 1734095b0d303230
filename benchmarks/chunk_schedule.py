"""Chunked long sequences as a schedule on the bench (issue 50, item 4; `planner/oracles/chunk_schedule.py`).

Per scenario, on the bench's own batches, cost models and hydraulis (the contexts `hydraulis bench` tries
for it: with and without recompute where needed, interleaving on and off, memory policies per micro-batch):
each batch's schedule as hydraulis plans it, and the variant in which a set of its long sequences (the
KEEP longest stay in the plan, the TAKE next run chunked) runs in chunks on the replicas of the rest's
schedule (`plan_chunked`: the chunks' real order on the pipeline, a chunk's memory beside the whole
sequence's K/V checked), the faster of the two per batch. The iteration times summed over the batches,
best context each way as the bench takes it; and the longest sequence's fastest pass alone per replica
size (GPUs), against the plain iteration. Simulated: load does not move the figures (it takes minutes:
every context proposes its pool).

    PYTHONPATH=src python benchmarks/chunk_schedule.py [SCENARIO ...]
"""

from __future__ import annotations

import dataclasses
import sys
from collections import Counter

import numpy as np

from hydraulis.baselines import make_policy
from hydraulis.bench import geomean, get_scenarios, hydraulis_contexts
from hydraulis.cost import load_cost_model
from hydraulis.cost.model import CostModel
from hydraulis.planner.oracles.chunk_schedule import ChunkedSchedule, chunk_run, chunk_time, plan_chunked
from hydraulis.planner.policy import PolicyContext
from hydraulis.planner.schedule import check_schedule
from hydraulis.specs import ClusterSpec

DEFAULT = ("long-7b-64g-longmix-2m-256k", "long-13b-128g-longmix-2m-512k", "long-7b-128g-stdlib-2m-512k")
KEEP = (0, 1, 2)  # how many of a batch's longest sequences stay in the plan (the long phase) ...
TAKE = (1, 2, 3, 5)  # ... and how many of the next longest run chunked: the candidate sets
SHORTEST = 8192  # no shorter sequence runs chunked: chunks are for long sequences


def candidate_sets(lengths: np.ndarray) -> list[np.ndarray]:
    """Positions of the batch's sequences ranked keep..keep + take by length, for each KEEP and TAKE, those of
    at least SHORTEST tokens."""
    order = np.argsort(-lengths, kind="stable")
    order = order[lengths[order] >= SHORTEST]
    sets = {tuple(sorted(order[keep : keep + take])) for keep in KEEP for take in TAKE if keep + take <= len(order)}
    return [np.array(s) for s in sorted(sets)]


def run_context(ctx: PolicyContext, batches: list[np.ndarray]) -> tuple[list[float], list[ChunkedSchedule | None]]:
    """Each batch's time as hydraulis plans it, and its best chunked variant (None: none holds)."""
    policy = make_policy("hydraulis", ctx)
    plain, chunked = [], []
    for step, b in enumerate(batches):
        schedule = policy.schedule(b, step)
        check_schedule(schedule, policy.cost)
        plain.append(schedule.iteration_time_s)
        variant = plan_chunked(lambda rest, step=step: policy.schedule(rest, step), policy.cost, ctx.num_gpus, b,
                               candidate_sets(b), [g for d in policy.pool for g in d.configs],
                               beat=schedule.iteration_time_s)
        if variant is not None:
            check_schedule(variant.schedule, policy.cost)
        chunked.append(variant)
    return plain, chunked


def describe(batches: list[np.ndarray], plain: list[float], chunked: list[ChunkedSchedule | None]) -> str:
    """Which batches gain from passes of their own, how many sequences and tokens those run (how many in
    chunks), and on what."""
    used = [(b, v) for b, t, v in zip(batches, plain, chunked, strict=True) if v and v.iteration_time_s < t]
    n = sum(len(b) for b in batches)
    placed = [(b, q) for b, v in used for q in v.placed]
    tokens = sum(int(b[q.position]) for b, q in placed)
    runs = Counter(f"{q.run.config.name}/{q.run.policy.label} k={q.run.k}" for _, q in placed)
    where = ", ".join(f"{k} x{m}" for k, m in runs.most_common(4)) or "none"
    return (f"{len(used)}/{len(batches)} batches run {len(placed)}/{n} sequences in passes of their own, "
            f"{sum(q.run.k > 1 for _, q in placed)} in chunks ({tokens / sum(int(b.sum()) for b in batches):.1%} "
            f"of tokens): {where}")


def passes_by_size(cost: CostModel, num_gpus: int, length: int) -> str:
    """The fastest chunked pass of `length` tokens alone, on the configs of each GPU count."""
    sizes: dict[int, float] = {}
    for g in cost.configs:
        if g.num_gpus <= num_gpus and (run := chunk_run(cost, g, num_gpus, length)) is not None:
            sizes[g.num_gpus] = min(sizes.get(g.num_gpus, np.inf), chunk_time(run))
    return ", ".join(f"{n} GPUs {t:.1f} s" for n, t in sorted(sizes.items()))


def main(args: list[str]) -> int:
    gains = []
    for s in get_scenarios(args or DEFAULT):
        cost = load_cost_model(s.profile)
        batches = s.sample(s.seed)
        ctx = PolicyContext.build(cost, ClusterSpec(s.num_gpus), batches, sample=s.sample(s.seed + 1000, 4))
        plain_s, best = np.inf, None  # the bench's hydraulis: its fastest context; the variant's: its own
        for c in hydraulis_contexts(dataclasses.replace(ctx, interleave=True)):
            plain, chunked = run_context(c, batches)
            with_chunks = [min(t, v.iteration_time_s) if v else t for t, v in zip(plain, chunked, strict=True)]
            print(f"  {s.name} on {c.cost.name}: {sum(plain):.2f} s plain, {sum(with_chunks):.2f} s with chunks",
                  flush=True)
            plain_s = min(plain_s, sum(plain))
            if best is None or sum(with_chunks) < best[0]:
                best = (sum(with_chunks), plain, chunked, c.cost.name)
        assert best is not None
        chunk_s = best[0]
        gains.append(plain_s / chunk_s)
        longest = max(int(b.max()) for b in batches)
        passes = passes_by_size(hydraulis_contexts(ctx)[0].cost, s.num_gpus, longest)
        print(f"  longest {longest:,} alone, fastest pass: {passes}")
        print(f"{s.name}: iteration {plain_s / len(batches):.2f} s plain, {chunk_s / len(batches):.2f} s with chunks "
              f"({plain_s / chunk_s:.4f}x; {best[3]}); {describe(batches, best[1], best[2])}", flush=True)
    print(f"geometric mean: {geomean(gains):.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
