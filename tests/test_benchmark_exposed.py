"""The exposed exchange time of benchmarks/peers.py's peers, measured on 2 gloo ranks with the tiny model.

DDP's figure is the tail of its synchronising backward after the last gradient: it must lie inside
the step, and a comm hook that holds every bucket's all-reduce back for `DELAY_S` must show in it in
full (nothing is left to compute after the last gradient, so nothing can hide the delay). FSDP2's
figure is the time in its collectives: one all-gather and one reduce-scatter per FSDP module a step.
"""

from __future__ import annotations

import time

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from test_benchmark_peers import load_peers  # noqa: E402

from hydraulis.optim import OptimSettings  # noqa: E402
from hydraulis.runtime.parallelism.batch import count_targets  # noqa: E402
from hydraulis.specs import MODELS  # noqa: E402

SPEC = MODELS["tiny"]
DELAY_S = 0.3
LENGTHS = ((40, 9), (33,))  # rank 0 runs two documents (one under no_sync), rank 1 one


def _timed_step(peer, docs, total, step) -> tuple[float, float]:
    start = time.perf_counter()
    _, _, exposed = peer.step(docs, total, step)
    return exposed, time.perf_counter() - start


def _delayed_allreduce(state, bucket):
    """DDP's default all-reduce hook, its result released DELAY_S after the all-reduce completes."""
    import torch.distributed as dist

    buffer = bucket.buffer().div_(dist.get_world_size())

    def late(fut):
        time.sleep(DELAY_S)
        return fut.value()[0]

    return dist.all_reduce(buffer, async_op=True).get_future().then(late)


def _worker() -> dict:
    from hydraulis.runtime.parallelism.launch import init_distributed

    env = init_distributed("cpu")
    peers = load_peers()
    g = torch.Generator().manual_seed(env.rank)
    docs = [torch.randint(0, SPEC.vocab, (s,), generator=g) for s in LENGTHS[env.rank]]
    total = count_targets([s for lengths in LENGTHS for s in lengths])
    out: dict = {}
    for name in ("ddp-doc", "ddp-packed", "fsdp2"):
        peer = peers.build_peer(name, SPEC, 1, OptimSettings(), 4, env.world_size)
        out[name] = [_timed_step(peer, docs, total, i) for i in range(2)]
        if name == "fsdp2":
            out["fsdp2_calls"] = dict(peer.exchange.calls)
    slow = peers.build_peer("ddp-doc", SPEC, 1, OptimSettings(), 4, env.world_size)
    slow.model.register_comm_hook(None, _delayed_allreduce)
    out["ddp-delayed"] = [_timed_step(slow, docs, total, i) for i in range(2)]
    return out


@pytest.mark.dist
def test_exposed_exchange_of_the_peers():
    from hydraulis.runtime.parallelism.launch import spawn

    ranks = spawn(_worker, 2, deadline_s=300)
    for rank, out in enumerate(ranks):
        for name in ("ddp-doc", "ddp-packed", "fsdp2", "ddp-delayed"):
            for exposed, step_s in out[name]:
                assert 0 < exposed < step_s, f"rank {rank} {name}: exposed {exposed:.4f} s of a {step_s:.4f} s step"
        for exposed, _ in out["ddp-delayed"]:
            assert exposed >= DELAY_S, f"rank {rank}: a {DELAY_S} s late all-reduce shows as {exposed:.3f} s"
        modules = SPEC.layers + 1  # fully_shard on every decoder layer and the root
        assert out["fsdp2_calls"] == {"all_gather": 2 * modules, "reduce_scatter": 2 * modules}
