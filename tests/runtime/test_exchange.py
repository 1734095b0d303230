"""The bucketed, overlapped exchange: small buckets and overlap train exactly as one large bucket per stripe with
nothing overlapped, within a measured memory bound."""

from __future__ import annotations

import pytest
import torch
from dist_launcher import run_workers
from exchange_workers import train_variants
from train_workers import WORLD, crafted_plans, settings

from hydraulis.cost.memory import shard_params
from hydraulis.parallel import Deployment, ParallelConfig
from hydraulis.runtime.optimizer.exchange_plan import ExchangePlan
from hydraulis.runtime.optimizer.layout import Role, ShardLayout
from hydraulis.specs import MODELS, ClusterSpec

SMALL, LARGE = 64 << 10, 256 << 20  # 64 KiB: several rounds per stripe on tiny; 256 MiB: one round for all


STEADY_TIMEOUT_S = 123.0


@pytest.fixture(scope="module")
def runs():
    s = settings()
    plans = crafted_plans(s)  # five steps switching deployments, one with an idle replica
    variants = [
        {"exchange_bucket_bytes": LARGE, "overlap": False},  # the reference: nothing overlaps
        {"exchange_bucket_bytes": SMALL, "timeout_s": STEADY_TIMEOUT_S},
        {"exchange_bucket_bytes": LARGE},
    ]
    return s, run_workers(train_variants, WORLD, s, plans, variants, deadline_s=300)


@pytest.mark.dist
def test_small_buckets_and_overlap_train_bit_identically_and_bound_the_exchange_peak(runs):
    s, results = runs
    stripes = ShardLayout(s.model, WORLD).stripes
    for large, small, overlapped in results:
        assert all(n == 1 for n in large["rounds"].values())  # tiny's stripes share one round
        assert all(n > 2 * stripes for n in small["rounds"].values()), small["rounds"]
        for other in (small, overlapped):
            assert torch.equal(other["master"], large["master"])
            assert other["losses"] == large["losses"] and other["grad_norms"] == large["grad_norms"]
        # torch's allocator, not the plan: two rounds in flight, each a send and a receive buffer of at most
        # half a bucket.
        assert small["measured_peak"] <= 2 * SMALL, small["measured_peak"]
        assert small["buffer_peak"] <= 2 * SMALL
        # Each exchange frees its buffers once gloo's worker has let go of them (collectives.py), never at the
        # wait's deadline (a reference of its own left counted made every exchange wait 50 ms).
        assert small["late_waits"] == overlapped["late_waits"] == 0
    # With one large bucket the whole exchange is one round: its peak is a shard's worth (both buffers), so
    # the bound above is not one any exchange would meet.
    total_bytes = 4 * ShardLayout(s.model, 1).total
    assert max(large["measured_peak"] for large, _, _ in results) >= total_bytes / 2 > 2 * SMALL


@pytest.mark.dist
def test_overlap_issues_rounds_from_the_layers_and_backward(runs):
    """Overlapped: gather rounds go out from forward's hooks and reduce rounds from backward's, not all at the
    ends; without overlap none does. A pipelined replica gathers ahead, so only its reduce overlaps."""
    s, results = runs
    for rank, (large, small, overlapped) in enumerate(results):
        assert all(g == 0 and r == 0 for g, r, _ in large["early"])
        for run in (small, overlapped):
            for plan, (gathered, reduced, rounds) in zip(crafted_plans(s), run["early"], strict=True):
                replica = next(r for r in plan.deployment.replicas if rank in r.devices)
                busy = plan.replicas[plan.deployment.replicas.index(replica)].micro_batches
                if not busy:
                    assert gathered == reduced == 0
                    continue
                assert reduced > 0, (rank, str(plan.deployment))
                if replica.config.pp == 1:
                    assert gathered > 0, (rank, str(plan.deployment))
                else:
                    assert gathered == 0
                assert gathered <= rounds and reduced <= rounds
        assert all(0 <= low <= high for low, high in overlapped["exposed"])


@pytest.mark.dist
def test_groups_take_the_steady_timeout_after_the_first_step_and_none_is_unused(runs):
    _, results = runs
    for rank, (_, small, _) in enumerate(results):
        assert small["timeouts"] == [STEADY_TIMEOUT_S]
        # The pool's 1x(tp2,pp2) would have built a group of its whole replica that nothing uses.
        assert (0, 1, 2, 3) not in small["groups"]
        assert all(rank in key for key in small["groups"])


@pytest.mark.parametrize("pool", ["4x(tp1,pp1)", "1x(tp2,pp1) + 2x(tp1,pp1)", "1x(tp2,pp2)", "2x(tp1,pp2)"])
def test_rounds_cover_each_shard_once_within_the_bucket(pool):
    """Over all rounds, every rank receives its whole compute shard and sends its whole gradient, once."""
    spec = MODELS["tiny"]
    layout = ShardLayout(spec, WORLD)
    deployment = Deployment.parse(pool, ClusterSpec(WORLD, gpus_per_node=WORLD))
    bucket = 100_000  # not a multiple of anything in the model
    for rank in range(WORLD):
        plan = ExchangePlan.build(layout, deployment, rank, bucket_bytes=bucket)
        assert plan.largest_buffer * 4 <= bucket
        got = {i: [] for i in range(len(plan.local))}
        sent = {i: [] for i in range(len(plan.local))}
        for rnd in plan.rounds:
            for i, off, n in rnd.gather_recv:
                got[i].append((off, off + n))
            for i, off, n in rnd.reduce_send:
                sent[i].append((off, off + n))
        for i, lp in enumerate(plan.local):
            assert _union(got[i]) == [(0, lp.numel)], lp.name
            a = lp.reduce[0] - lp.gather[0]
            assert _union(sent[i]) == [(a, a + lp.reduce[1] - lp.reduce[0])], lp.name


def _union(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Disjoint sorted ranges merged where they touch; overlapping ones fail (nothing moves twice)."""
    out: list[tuple[int, int]] = []
    for a, b in sorted(ranges):
        if out and a < out[-1][1]:
            raise AssertionError(f"range {(a, b)} overlaps {out[-1]}")
        if out and a == out[-1][1]:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


@pytest.mark.parametrize("model", ["tiny", "small"])
def test_the_memory_models_shard_is_what_the_layout_gives_each_rank(model):
    """cost.memory.shard_params (numpy, from the shape) against the runtime's own parameter shards."""
    spec = MODELS[model]
    layout = ShardLayout(spec, 1)
    for tp, pp in ((1, 1), (2, 1), (1, 2), (2, 2)):
        config = ParallelConfig(tp, pp)
        for stage in range(pp):
            held = sum(p.numel for p in layout.local_params(Role(config, stage, 0)))
            assert shard_params(spec, config, stage) == held, (model, config, stage)


@pytest.mark.parametrize(
    "pool", ["1x(tp2,pp1) + 2x(tp1,pp1)", "1x(tp4,pp1)", "1x(tp2,pp2)", "1x(tp1,pp1,cp2) + 1x(tp2,pp1)"]
)
def test_ranks_of_a_stage_wait_for_the_same_rounds(pool):
    """TP and CP peers block on each other inside a layer, so a layer must ask every peer for the same rounds:
    a rank waiting for a round its peer had not issued, while that peer waited in the layer's all-reduce, hung."""
    spec = MODELS["tiny"]
    layout = ShardLayout(spec, WORLD)
    deployment = Deployment.parse(pool, ClusterSpec(WORLD, gpus_per_node=WORLD))
    plans = {r: ExchangePlan.build(layout, deployment, r, bucket_bytes=20_000) for r in range(WORLD)}
    own = {r: {p.name: k for p, k in zip(plan.local, plan.gather_needs, strict=True)} for r, plan in plans.items()}
    for replica in deployment.replicas:
        for stage in {_first_layer(plans[r]) for r in replica.devices}:
            ranks = [r for r in replica.devices if _first_layer(plans[r]) == stage]
            assert len(ranks) == replica.config.tp * replica.config.cp
            assert len({tuple(sorted(own[r].items())) for r in ranks}) == 1, (pool, ranks)
            # ... and each covers what that rank itself receives: the last round writing each parameter
            for r in ranks:
                for k, rnd in enumerate(plans[r].rounds):
                    for i, _, _ in rnd.gather_recv:
                        assert plans[r].gather_needs[i] >= k


def _first_layer(plan: ExchangePlan) -> str:
    """Which stage a rank computes, by its first block."""
    return next(p.name.split(".")[1] for p in plan.local if p.name.startswith("layers."))


@pytest.mark.parametrize("blocks", [1, 3])
def test_the_reduce_waits_until_the_stages_last_blocks_are_through_backward(blocks):
    """The first reduce round goes out once a parameter outside the head, the final norm and the stage's last
    `reduce_after` blocks is final (cost/memory.py's `reduce_wait`: their activations freed make its room)."""
    from hydraulis.optim import AdamWSettings
    from hydraulis.runtime.optimizer.exchange import ReduceStream
    from hydraulis.runtime.optimizer.sharded import ShardedOptimizer

    spec = MODELS["tiny"]
    opt = ShardedOptimizer(ShardLayout(spec, 1), 0, AdamWSettings(), bucket_bytes=20_000)
    plan = opt.exchange_plan(Deployment.parse("1x(tp1,pp1)", ClusterSpec(1, gpus_per_node=1)))
    stream = ReduceStream(opt, plan, lambda i: (None, None), torch.float32, reduce_after=blocks)

    def depth(name: str) -> int:  # backward's order: the head and norm, then the blocks from the last
        return -1 if not name.startswith("layers.") else spec.layers - 1 - int(name.split(".")[1])

    for p in sorted(plan.local, key=lambda p: depth(p.name)):
        if stream.issued == 0:
            assert not opt.grad.allocated  # the reduced gradient waits with the buffers
        stream.accumulated(p.name, 1)
        if depth(p.name) < blocks:
            assert stream.issued == 0, p.name
        else:
            assert stream.issued > 0 and opt.grad.allocated, p.name
    stream.finish()
    assert stream.done and len(plan.rounds) > 2 * spec.layers
