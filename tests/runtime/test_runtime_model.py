"""Single-process checks: packing, packed attention, RoPE restart, loss, and the tp1pp1 step."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from hydraulis.cost.policies import MemoryPolicy
from hydraulis.errors import HydraulisError
from hydraulis.runtime import (
    IGNORE_INDEX,
    StageModel,
    TensorParallel,
    attention_backend,
    concatenate_documents,
    count_targets,
    head_cross_entropy,
    single_process_groups,
    train_step,
    varlen_attention,
)
from hydraulis.runtime.modeling.model import apply_rope, rope_tables
from hydraulis.runtime.optimizer.layout import reset_parameters
from hydraulis.specs import MODELS


def dense_masked_attention(q, k, v, seqlens):
    """Reference: one (T, T) attention with a block-diagonal causal mask, KV heads repeated."""
    total = q.shape[0]
    doc = torch.repeat_interleave(torch.arange(len(seqlens)), torch.tensor(seqlens))
    pos = torch.arange(total)
    mask = (doc[:, None] == doc[None, :]) & (pos[None, :] <= pos[:, None])
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / q.shape[-1] ** 0.5
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_packed_attention_equals_dense_masked_reference(kv_heads):
    seqlens = [7, 1, 13, 4]
    total = sum(seqlens)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(total, 4, 16, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(total, kv_heads, 16, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(total, kv_heads, 16, generator=g, dtype=torch.float64, requires_grad=True)
    cu = torch.tensor([0, 7, 8, 21, 25], dtype=torch.int32)
    out = varlen_attention(q, k, v, cu, max(seqlens))
    ref = dense_masked_attention(q, k, v, seqlens)
    torch.testing.assert_close(out, ref)
    upstream = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), upstream)
    ref_grads = torch.autograd.grad(ref, (q, k, v), upstream)
    for a, b in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_packed_attention_takes_the_fused_kernel_on_cpu(kv_heads):
    """With SDPA limited to its flash kernel, the math fallback raises: the packed path must never need it."""
    seqlens = [96, 1, 33, 7]
    total = sum(seqlens)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(total, 4, 16, generator=g, requires_grad=True)
    k = torch.randn(total, kv_heads, 16, generator=g, requires_grad=True)
    v = torch.randn(total, kv_heads, 16, generator=g, requires_grad=True)
    cu = torch.tensor([0, 96, 97, 130, 137], dtype=torch.int32)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        out = varlen_attention(q, k, v, cu, max(seqlens))
        grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    ref = dense_masked_attention(q, k, v, seqlens)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)
    ref_grads = torch.autograd.grad(ref, (q, k, v), torch.ones_like(ref))
    for a, b in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_model_step_runs_on_the_fused_kernel_only():
    model = StageModel(MODELS["tiny"])
    batch = concatenate_documents([list(range(1, 40)), list(range(5, 70))])
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        logits = model(batch.tokens, batch)
        logits.sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_cpu_uses_per_document_sdpa():
    assert attention_backend("cpu", torch.float32) == "sdpa-per-document"
    assert attention_backend("cpu", torch.bfloat16) == "sdpa-per-document"


def test_cuda_bf16_takes_a_varlen_flash_kernel():
    """Selected by device, dtype and head size (run on a GPU by benchmarks/gpu_check.py)."""
    from hydraulis.runtime.modeling.blockwise_attention import block_kernel

    varlen = importlib.util.find_spec("torch.nn.attention.varlen") is not None
    expected = {"torch-varlen-flash"} if varlen else {"flash-attn-varlen", "sdpa-per-document"}
    assert attention_backend("cuda", torch.bfloat16) in expected
    assert attention_backend("cuda", torch.float32) == "sdpa-per-document"
    assert attention_backend("cuda", torch.bfloat16, head_dim=12) == "sdpa-per-document"  # not a multiple of 8
    assert block_kernel("cuda", torch.bfloat16, 128).name == "cuda-flash"
    assert block_kernel("cuda", torch.bfloat16, 12).name == "math"


def test_pack_documents_targets_never_cross_documents():
    batch = concatenate_documents([[10, 11, 12], [20, 21], [30]], pad_to_multiple=4)
    assert batch.tokens.tolist() == [10, 11, 12, 20, 21, 30, 0, 0]
    x = IGNORE_INDEX
    assert batch.targets.tolist() == [11, 12, x, 21, x, x, x, x]
    assert batch.positions.tolist() == [0, 1, 2, 0, 1, 0, 0, 1]
    assert batch.cu_seqlens.tolist() == [0, 3, 5, 6, 8]
    assert batch.max_seqlen == 3
    assert batch.num_targets == count_targets([3, 2, 1]) == 3


def test_pack_documents_rejects_empty():
    with pytest.raises(HydraulisError):
        concatenate_documents([])
    with pytest.raises(HydraulisError):
        concatenate_documents([[1, 2], []])


def test_rope_positions_restart_at_each_document():
    spec = MODELS["tiny"]
    model = StageModel(spec)
    reset_parameters(model, 7)
    g = torch.Generator().manual_seed(3)
    docs = [torch.randint(0, spec.vocab, (n,), generator=g) for n in (9, 5, 12)]
    packed = concatenate_documents(docs)
    with torch.no_grad():
        logits = model(packed.tokens, packed)
        start = 0
        for doc in docs:
            alone = concatenate_documents([doc])
            torch.testing.assert_close(logits[start : start + len(doc)], model(alone.tokens, alone))
            start += len(doc)


def test_rope_is_a_relative_rotation():
    cos, sin = rope_tables(torch.tensor([0, 3, 10, 13]), 16, torch.float64)
    q = torch.randn(1, 2, 16, dtype=torch.float64)
    k = torch.randn(1, 2, 16, dtype=torch.float64)
    rotated_q = [apply_rope(q, cos[i : i + 1], sin[i : i + 1]) for i in range(4)]
    rotated_k = [apply_rope(k, cos[i : i + 1], sin[i : i + 1]) for i in range(4)]
    torch.testing.assert_close(apply_rope(q, cos[:1], sin[:1]), q)  # position 0: no rotation
    # q at 3 against k at 0 scores like q at 13 against k at 10.
    torch.testing.assert_close((rotated_q[1] * rotated_k[0]).sum(-1), (rotated_q[3] * rotated_k[2]).sum(-1))


@pytest.mark.parametrize("tokens", [9, 700])  # one chunk; several (at least LOSS_CHUNK_MIN_ROWS rows each)
def test_chunked_head_cross_entropy_equals_torch_on_whole_logits(tokens):
    """Loss and both gradients of the chunked head against F.cross_entropy on the full logits; padded vocabulary
    columns (beyond `valid`) take no probability."""
    g = torch.Generator().manual_seed(1)
    h = torch.randn(tokens, 16, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(40, 16, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 37, (tokens,), generator=g)
    targets[[2, 5]] = IGNORE_INDEX
    loss = head_cross_entropy(h, weight, targets, 0, 37, TensorParallel())
    logits = (h @ weight.t())[:, :37]
    ref = F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum")
    torch.testing.assert_close(loss, ref)
    upstream = torch.tensor(0.37, dtype=torch.float64)
    got = torch.autograd.grad(loss, (h, weight), upstream)
    want = torch.autograd.grad(ref, (h, weight), upstream)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)
    assert got[1][37:].abs().max() == 0  # padded rows of the head: no gradient


def test_single_process_step_equals_per_document_reference():
    """tp1pp1: micro-batches of several documents and different lengths, loss over the whole batch."""
    spec = MODELS["tiny"]
    g = torch.Generator().manual_seed(5)
    lengths = [11, 4, 19, 7, 2, 15]
    docs = [torch.randint(0, spec.vocab, (n,), generator=g) for n in lengths]
    total = count_targets(lengths)

    model = StageModel(spec)
    reset_parameters(model, 11)
    batches = [concatenate_documents(docs[0:2]), concatenate_documents(docs[2:5]), concatenate_documents(docs[5:])]
    result = train_step(model, single_process_groups(), batches, total)

    ref = StageModel(spec)
    reset_parameters(ref, 11)
    loss = sum(
        F.cross_entropy(ref(b.tokens, b), b.targets, ignore_index=IGNORE_INDEX, reduction="sum")
        for b in (concatenate_documents([d]) for d in docs)
    )
    (loss / total).backward()
    assert result.loss == pytest.approx(float(loss.detach()) / total, rel=1e-6)
    assert result.num_targets == total
    for (name, p), (_, r) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        assert float((p.grad - r.grad).norm() / r.grad.norm()) < 1e-5, name


def test_layout_errors_are_user_errors():
    with pytest.raises(HydraulisError, match="split evenly"):
        StageModel(MODELS["tiny"], num_stages=3)


def test_recompute_gives_the_same_gradients():
    """Activation recompute (checkpointed blocks: a micro-batch under full recompute) changes memory, never the
    loss or a gradient."""
    spec = MODELS["tiny"]
    batch = concatenate_documents([torch.randint(0, spec.vocab, (n,), generator=torch.Generator().manual_seed(n))
                            for n in (9, 30, 4)])
    grads = []
    for policy in (MemoryPolicy.NONE, MemoryPolicy.FULL):
        model = StageModel(spec)
        reset_parameters(model, 3)
        logits = model(batch.tokens, dataclasses.replace(batch, policy=int(policy)))
        torch.nn.functional.cross_entropy(logits, batch.targets, ignore_index=IGNORE_INDEX).backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, rtol=1e-6, atol=1e-7)
