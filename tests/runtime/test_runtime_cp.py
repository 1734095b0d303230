"""Context parallelism on 4 gloo ranks: the loss and every gradient of the single-process reference and of HF.

Each micro-batch mixes one long document, which `split_for_cp` cuts into
zigzag chunks over the CP ranks, with short ones that stay whole (a one-token
document too); one more is too small to give every CP rank a token, so some
run on zero tokens. Weights are random and scaled so that attention is far
from uniform (a wrong causal mask or a wrong position would show). cp2 (two
replicas, one on a permuted rank list), cp4 (permuted), tp2 x cp2 (with and
without sequence parallelism) and cp2 x pp2 (also with recompute) each
train one step.
"""

from __future__ import annotations

import functools

import cp_workers
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from dist_launcher import run_workers

from hydraulis.context import split_for_cp
from hydraulis.errors import HydraulisError
from hydraulis.parallel import ParallelConfig
from hydraulis.runtime import IGNORE_INDEX, StageModel, concatenate_documents, count_targets
from hydraulis.runtime.optimizer.layout import ShardLayout, full_shapes
from hydraulis.runtime.parallelism.batch import concatenate_cp_shard
from hydraulis.runtime.parallelism.groups import check_replica, cp_ranks, rank_roles
from hydraulis.runtime.storage.hf import hf_config, to_hf_state_dict
from hydraulis.specs import MODELS

RTOL = 1e-5
SPEC = MODELS["tiny"]  # 4 heads, 2 KV heads (GQA)
LENGTHS = (61, 5, 3, 9, 40, 7, 1, 12, 3)
MICRO_BATCHES = ((0, 1, 2), (3, 4, 5, 6), (7,), (8,))


@functools.cache
def weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    state = {}
    for name, shape in full_shapes(SPEC).items():
        if name.endswith("norm.weight"):
            state[name] = 1 + 0.3 * torch.randn(shape, generator=g)
        elif name == "embedding.weight":
            state[name] = torch.randn(shape, generator=g)
        else:  # (out, in): unit-variance outputs, attention logits of order one
            state[name] = torch.randn(shape, generator=g) * shape[1] ** -0.5
    return state


@functools.cache
def documents() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(12)
    return tuple(torch.randint(0, SPEC.vocab, (s,), generator=g) for s in LENGTHS)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@functools.cache
def our_reference(docs: tuple[torch.Tensor, ...] | None = None) -> tuple[float, dict[str, torch.Tensor]]:
    """One process, one document at a time, F.cross_entropy (the test's documents unless given)."""
    docs = documents() if docs is None else docs
    model = StageModel(SPEC)
    model.load_full_state_dict(weights())
    loss = torch.zeros(())
    for doc in docs:
        batch = concatenate_documents([doc])
        loss = loss + F.cross_entropy(model(batch.tokens, batch), batch.targets, ignore_index=IGNORE_INDEX,
                                      reduction="sum")
    loss = loss / count_targets([len(d) for d in docs])
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}


@functools.cache
def hf_reference() -> tuple[float, dict[str, torch.Tensor]]:
    """transformers' LlamaForCausalLM (eager attention) on each document alone, our weights."""
    transformers = pytest.importorskip("transformers")
    from hydraulis.runtime.storage.hf import from_hf_state_dict

    config = hf_config(SPEC)
    config._attn_implementation = "eager"
    model = transformers.LlamaForCausalLM(config).float()
    model.load_state_dict(to_hf_state_dict(weights(), SPEC))
    losses = []
    for doc in documents():
        logits = model(input_ids=doc[None], use_cache=False).logits[0]
        losses.append(F.cross_entropy(logits[:-1], doc[1:], reduction="sum"))
    loss = sum(losses) / count_targets(LENGTHS)
    loss.backward()
    return float(loss.detach()), from_hf_state_dict({n: p.grad for n, p in model.named_parameters()}, SPEC)


@pytest.fixture(scope="module")
def results():
    return run_workers(cp_workers.run_scenarios, 4, SPEC, weights(), list(documents()), MICRO_BATCHES, deadline_s=150)


def test_micro_batches_mix_split_and_whole_documents():
    for cp in (2, 4):
        for mb in MICRO_BATCHES[:2]:
            split = split_for_cp([LENGTHS[i] for i in mb], cp).split
            assert split.any() and not split.all(), (cp, mb)
        # the last micro-batch, one document of 3 tokens, leaves CP ranks without tokens
        assert (split_for_cp([LENGTHS[i] for i in MICRO_BATCHES[-1]], cp).rank_tokens() == 0).any()


def check(results, scenario: str, ref_loss: float, ref_grads: dict[str, torch.Tensor]) -> dict[str, float]:
    """Every replica's summed loss and every rank's gradients against a reference; returns the worst errors."""
    reports = [r[scenario] for r in results]
    losses: dict[int, float] = {}
    for rep in reports:
        if rep["loss"] is not None:
            losses[rep["replica"]] = losses.get(rep["replica"], 0.0) + rep["loss"]
    replicas = {rep["replica"] for rep in reports}
    assert set(losses) == replicas
    for loss in losses.values():
        assert loss == pytest.approx(ref_loss, rel=RTOL)
    worst = {"abs": 0.0, "rel": 0.0, "loss": max(abs(v - ref_loss) for v in losses.values())}
    for replica in replicas:
        seen = set()
        for rep in (r for r in reports if r["replica"] == replica):
            for name, g in rep["grads"].items():
                err = rel_err(g, ref_grads[name])
                assert err <= RTOL, f"{scenario} stage {rep['stage']} cp {rep['cp_rank']}: {name} rel err {err:.2e}"
                worst["rel"] = max(worst["rel"], err)
                worst["abs"] = max(worst["abs"], float((g - ref_grads[name]).abs().max()))
                seen.add(name)
        assert seen == set(ref_grads)
    return worst


@pytest.mark.dist
@pytest.mark.parametrize("scenario", list(cp_workers.SCENARIOS))
def test_context_parallel_matches_single_process(results, scenario):
    worst = check(results, scenario, *our_reference())
    print(f"{scenario} vs reference: {worst}")


@pytest.mark.dist
@pytest.mark.parametrize("scenario", list(cp_workers.SCENARIOS))
def test_context_parallel_matches_hf(results, scenario):
    worst = check(results, scenario, *hf_reference())
    print(f"{scenario} vs HF: {worst}")


LONG_LENGTHS = (1021, 387, 2, 700, 650)
LONG_MICRO_BATCHES = ((0, 1, 2), (3, 4))
LONG_SCENARIOS = ("cp2", "cp4", "tp2cp2-sp")


@pytest.mark.dist
def test_context_parallel_on_long_documents_with_uneven_chunks():
    """Documents of 387-1021 tokens cut into chunks of unequal lengths (1021 = 7 x 128 + 125 at cp4):
    every chunk's prefix block holds up to 893 gathered keys, its diagonal block up to 256."""
    g = torch.Generator().manual_seed(13)
    docs = tuple(torch.randint(0, SPEC.vocab, (n,), generator=g) for n in LONG_LENGTHS)
    for cp in (2, 4):
        split = split_for_cp(LONG_LENGTHS[:3], cp)
        chunks = {int(b - a) for r in range(cp) for d, a, b in zip(*split.segments(r), strict=True) if d == 0}
        assert len(chunks) > 1, (cp, chunks)  # uneven
    results = run_workers(cp_workers.run_scenarios, 4, SPEC, weights(), list(docs), LONG_MICRO_BATCHES,
                          LONG_SCENARIOS, deadline_s=150)
    for scenario in LONG_SCENARIOS:
        worst = check(results, scenario, *our_reference(docs))
        print(f"{scenario} on long documents vs reference: {worst}")


@pytest.mark.dist
def test_cp_ranks_hold_balanced_shares(results):
    for rep in (r["cp4"] for r in results):
        for mb, tokens in zip(MICRO_BATCHES, rep["tokens"], strict=True):
            total = sum(LENGTHS[i] for i in mb)
            assert tokens <= -(-total // 4) + 8


# ------------------------------------------------------------ one process: layout and shards


def test_rank_layout_is_stage_major_tp_contiguous_cp_strided():
    config = ParallelConfig(2, 2, 2)
    ranks = tuple(range(8))
    roles = rank_roles(config, ranks)
    # stage 0 holds ranks 0..3: local index cp_rank * tp + tp_rank
    assert [roles[r] for r in range(4)] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1)]
    assert roles[5] == (1, 0, 1)
    assert cp_ranks(config, ranks, 1, 0) == (4, 6)
    # TP ranks follow sorted order within a TP group; CP groups keep CP-rank order
    assert cp_ranks(config, (3, 1, 0, 2, 4, 5, 6, 7), 0, 0) == (1, 0)


def test_shards_cover_the_micro_batch_once_with_its_targets():
    docs = [documents()[i] for i in MICRO_BATCHES[1]]
    full = concatenate_documents(docs)
    rows = lambda b: sorted(zip(b.positions.tolist(), b.tokens.tolist(), b.targets.tolist(), strict=True))  # noqa: E731
    shards = [concatenate_cp_shard(docs, 4, r) for r in range(4)]
    # (global position, token, target) of every row over all CP ranks: the micro-batch's rows, once each
    assert sorted(row for s in shards for row in rows(s)) == rows(full)
    padded = [concatenate_cp_shard(docs, 4, r, pad_to_multiple=4) for r in range(4)]
    assert all(p.num_tokens % 4 == 0 for p in padded)
    assert [p.num_targets for p in padded] == [s.num_targets for s in shards]


def test_bad_cp_input_is_one_line():
    with pytest.raises(HydraulisError, match=r"CP rank 2 is outside 0\.\.1") as info:
        concatenate_cp_shard([torch.arange(9)], 2, 2)
    assert "\n" not in str(info.value)
    model = StageModel(SPEC)  # no CP group
    model.load_full_state_dict(weights())
    batch = concatenate_cp_shard([documents()[0]], 2, 0)
    with pytest.raises(HydraulisError, match=r"micro-batch was split for cp=2, the group has cp=1"):
        model(batch.tokens, batch)
    with pytest.raises(HydraulisError, match=r"tp2pp1cp2 needs 4 ranks, got 3"):
        check_replica(ParallelConfig(2, 1, 2), (0, 1, 2), 4)
    assert np.isfinite(our_reference()[0])


# ------------------------------------------------------------ training: 1x(tp1,pp1,cp4) and cp2 + 2x(tp1,pp1)


@pytest.mark.dist
def test_cp_training_matches_single_process():
    """A document 4x the tp1pp1 cap, trained a few steps with a cp pool: the losses and weights of one process."""
    from test_trainer import unflatten
    from train_workers import reference

    s = cp_workers.cp_train_settings()
    assert (s.parallel.cost.cap(ParallelConfig(1, 1), 4) * 4 == cp_workers.LONG_DOC
            <= s.parallel.cost.cap(ParallelConfig(1, 1, 4), 4))
    docs = cp_workers.cp_train_corpus(s.model.vocab)
    smp = cp_workers.cp_train_sampler(docs)
    assert any(cp_workers.LONG_DOC in smp.next_batch().lengths for _ in range(s.train.steps))
    results = run_workers(cp_workers.train_cp, 4, s, deadline_s=150)
    ref_losses, ref_params = reference(s, docs, cp_workers.cp_train_sampler(docs))
    got = [m["loss"] for m in results[0]["metrics"]]
    print("cp training losses", got, "reference", ref_losses, [m["deployment"] for m in results[0]["metrics"]])
    np.testing.assert_allclose(got, ref_losses, rtol=1e-5)
    # both deployments ran, switching: the long document's batches on cp4, the others on cp2 + 2x tp1pp1
    assert {m["deployment_index"] for m in results[0]["metrics"]} == {0, 1}
    params = unflatten(ShardLayout(s.model, len(results)).assemble([r["master"] for r in results]), ref_params)
    worst = max(rel_err(params[n], ref_params[n]) for n in ref_params)
    print("cp training: worst parameter rel err", worst)
    assert worst < 1e-5
