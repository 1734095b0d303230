"""The peers of benchmarks/peers.py train Hydraulis's objective: same loss and gradients as `StageModel`.

benchmarks/peers.py compares tokens/s of Hydraulis with transformers' LlamaForCausalLM under DDP;
that comparison means something only if the peers compute the same function. Here, in one
process, the per-document peer and the packed-row peer (4-D block-diagonal mask) on one tiny batch
meet Hydraulis's single-process reference: one packed micro-batch through `StageModel`, loss
divided by the batch's targets. Same initial weights (the optimizer's seeded values), fp32.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from hydraulis.runtime import StageModel, concatenate_documents, count_targets, micro_batch_loss  # noqa: E402
from hydraulis.runtime.optimizer.layout import ShardLayout  # noqa: E402
from hydraulis.runtime.storage.hf import from_hf_state_dict  # noqa: E402
from hydraulis.specs import MODELS  # noqa: E402

PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "peer_models.py"
SPEC = MODELS["tiny"]  # GQA: 4 heads, 2 KV heads
SEED = 3
LENGTHS = (37, 5, 61, 1, 18)  # a one-token document has no target


def load_peers():
    """The benchmark's helper module, loaded by path as tests/test_benchmarks_import.py loads benchmarks."""
    if "bench_peer_models" not in sys.modules:
        spec = importlib.util.spec_from_file_location("bench_peer_models", PATH)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # as an import does (its dataclass looks the module up)
        spec.loader.exec_module(module)
    return sys.modules["bench_peer_models"]


@pytest.fixture(scope="module")
def reference():
    """Hydraulis's single-process model on the whole batch: loss and gradients by full-model name."""
    g = torch.Generator().manual_seed(11)
    docs = [torch.randint(0, SPEC.vocab, (s,), generator=g) for s in LENGTHS]
    model = StageModel(SPEC)
    model.load_full_state_dict(ShardLayout(SPEC, 1).full_state_dict(SEED))
    batch = concatenate_documents(docs)
    loss = micro_batch_loss(model, batch.tokens, batch) / count_targets(LENGTHS)
    loss.backward()
    return docs, float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("kind", ["document", "packed", "document-checkpointed"])
def test_peer_matches_stage_model(reference, kind):
    """The checkpointed peer (`ddp-doc-gc`, `fsdp2-ac` in the bounded setting) recomputes each layer in
    backward: the same loss and gradients."""
    peers = load_peers()
    docs, loss, grads = reference
    model = peers.hf_model(SPEC, SEED)
    if kind == "document-checkpointed":
        peers.checkpoint_layers(model)
    total = count_targets(LENGTHS)
    step = peers.packed_backward if kind == "packed" else peers.document_backward
    loss_sum = step(model, docs, total)
    assert float(loss_sum) / total == pytest.approx(loss, rel=1e-6, abs=1e-7)
    theirs = from_hf_state_dict({n: p.grad for n, p in model.named_parameters()}, SPEC)
    assert set(theirs) == set(grads)
    for name, g in grads.items():
        err = float((theirs[name] - g).norm() / g.norm())
        assert err <= 1e-5, f"{kind}: {name} rel err {err:.2e}"


def test_packed_mask_is_block_diagonal_causal():
    peers = load_peers()
    mask = peers.block_causal_mask(torch.tensor([0, 2, 5], dtype=torch.int32))[0, 0]
    expected = torch.tensor(
        [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 1, 1, 1]], dtype=torch.bool
    )
    assert torch.equal(mask, expected)


def test_split_by_tokens_is_greedy_in_batch_order():
    peers = load_peers()
    # 10 -> r0, 3 -> r1, 4 -> r2, 2 -> r3, 5 -> r3 (2), 1 -> r1 (3), 7 -> r1 (4, before r2's 4 by rank)
    assert peers.split_by_tokens([10, 3, 4, 2, 5, 1, 7], 4) == [[0], [1, 5, 6], [2], [3, 4]]
