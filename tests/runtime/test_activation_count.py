"""The memory model's count of activations (numpy, from the shape) against what torch saves and allocates.

`cost/activations.py` never imports torch; here one process runs the runtime's `StageModel` and counts the
tensors autograd saves for backward (each storage once, parameters excluded) and the CPU allocator's peak
over a step, independently of those formulas.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from hydraulis.cost import AnalyticCostModel
from hydraulis.cost.activations import LOSS_CHUNK_MIN_ROWS, layer_bytes, rope_bytes
from hydraulis.cost.memory import rank_memory
from hydraulis.cost.policies import LIGHTEST_FIRST, MemoryPolicy
from hydraulis.parallel import ParallelConfig
from hydraulis.runtime import StageModel, concatenate_documents, single_process_groups, train_step
from hydraulis.runtime.metering.memory_meter import PeakMeter
from hydraulis.runtime.modeling.main_grad import attach_main_grads
from hydraulis.specs import MODELS, Architecture, get_device

TINY = MODELS["tiny"]
QWEN2 = replace(TINY, name="tiny-qwen2", arch=Architecture(family="qwen2", qkv_bias=True))
QWEN3 = replace(TINY, name="tiny-qwen3", arch=Architecture(family="qwen3", qk_norm=True, head_dim=32))
DTYPES = {4: torch.float32, 2: torch.bfloat16}


def _saved_bytes(model: StageModel, batch) -> int:
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() and storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(batch.tokens, batch)
    return sum(seen.values())


@pytest.mark.parametrize("dtype_bytes", [4, 2])
@pytest.mark.parametrize("spec", [TINY, QWEN2, QWEN3], ids=lambda s: s.name)
def test_layers_keep_what_the_count_says(spec, dtype_bytes):
    """Every layer's saved tensors, and RoPE's tables once: to the byte, for LLaMA, Qwen2's biases and
    Qwen3's q/k norms, in fp32 (the norms' fp32 input is the input itself) and bf16 (a copy of it)."""
    torch.manual_seed(0)
    model = StageModel(spec, stage=0, num_stages=2, dtype=DTYPES[dtype_bytes])  # the first two layers, no head
    batch = concatenate_documents([torch.randint(0, spec.vocab, (n,)) for n in (100, 60, 96)])
    counted = batch.num_tokens * (2 * layer_bytes(spec, 1, dtype_bytes) + rope_bytes(spec, dtype_bytes))
    assert len(model.layers) == 2
    ids = 8 * batch.num_tokens  # the embedding keeps the token ids: the batch's own tensor, there anyway
    assert _saved_bytes(model, batch) == counted + ids


@pytest.mark.parametrize(("dtype_bytes", "micro_batches"), [(4, 2), (2, 1)])
def test_a_steps_peak_is_the_counted_one(dtype_bytes, micro_batches):
    """One process, tiny with a 65,536-token vocabulary (its head dominates, and the loss takes three chunks of
    256 rows): the allocator's peak over forward and backward of the micro-batches, the parameters already
    there, is rank_memory's activations' phase to 0.1% (the gradients' sums meet the later micro-batches'
    activations; with one micro-batch the loss's kept gradients stand for the head's)."""
    spec = replace(TINY, name="tiny-wide", vocab=1 << 16)
    torch.manual_seed(0)
    model = StageModel(spec, dtype=DTYPES[dtype_bytes])
    if dtype_bytes == 2:
        attach_main_grads(model)
    tokens = 3 * LOSS_CHUNK_MIN_ROWS - 168
    batches = [concatenate_documents([torch.randint(0, spec.vocab, (tokens // 3,)) for _ in range(3)])
               for _ in range(micro_batches)]
    with PeakMeter() as meter:
        train_step(model, single_process_groups(), batches, micro_batches * tokens, reduce_partial_grads=False)
    memory = AnalyticCostModel(spec, get_device("cpu")).memory
    rank = rank_memory(memory, spec, ParallelConfig(1, 1), 0, 1, tokens, dtype_bytes, 0,
                       micro_batches=micro_batches)
    assert meter.peak_bytes == pytest.approx(rank.with_activations, rel=1e-3)
    assert rank.loss_transient > 0 and rank.activations > 0


@pytest.mark.parametrize("policy", list(MemoryPolicy), ids=lambda p: p.label)
@pytest.mark.parametrize("micro_batches", [1, 2])
def test_each_memory_policy_peaks_as_counted(policy, micro_batches):
    """Each memory policy per micro-batch (`MicroBatchInput.policy`: selective checkpoints each block's MLP, full
    each block) against its count: the allocator's peak over a step of tiny (the head's vocabulary small, so
    the layers dominate) is rank_memory's activations' phase under that policy within 15% (measured: none
    +0.2%, selective -4%, full -6 to -7%); recompute lowers it, selective less than full."""
    torch.manual_seed(0)
    model = StageModel(TINY)
    tokens = 1536
    batches = [replace(concatenate_documents([torch.randint(0, TINY.vocab, (tokens // 2,)) for _ in range(2)]),
                       policy=int(policy)) for _ in range(micro_batches)]
    with PeakMeter() as meter:
        train_step(model, single_process_groups(), batches, micro_batches * tokens, reduce_partial_grads=False)
    memory = AnalyticCostModel(TINY, get_device("cpu")).memory
    ranks = {p: rank_memory(memory, TINY, ParallelConfig(1, 1), 0, 1, tokens, 4, 0, p, micro_batches)
             for p in MemoryPolicy}
    # One process has no reduce: the activations' phase before it (the reduced gradient is the trainer's).
    counted = {p: r.grads_with_activations + r.activations + max(r.loss_transient, r.backward)
               for p, r in ranks.items()}
    print(f"{policy.label} x{micro_batches}: measured {meter.peak_bytes}, counted {counted[policy]:.0f}")
    assert meter.peak_bytes == pytest.approx(counted[policy], rel=0.15)
    none, selective, full = (counted[p] for p in LIGHTEST_FIRST)
    assert none > selective > full


def test_the_meter_drops_the_allocators_unknown_block_line_and_passes_others_on(capfd):
    """Freeing blocks allocated before the window makes torch's CPU allocator log "Memory block of unknown size
    was allocated before the profiling started" (one in 1000: 3000 frees log it three times); the meter keeps that
    line off stderr, and what else reached stderr meanwhile (here a line written to fd 2) still arrives."""
    import os

    before = [torch.empty(64) for _ in range(3000)]
    with PeakMeter() as meter:  # kept first: the frees may count below the window's start (the profiler's
        kept = torch.ones(1024)  # sizes of blocks an earlier window saw at those addresses), never above it
        before.clear()
        os.write(2, b"a line of someone else's\n")
    assert meter.peak_bytes >= kept.numel() * 4
    _, err = capfd.readouterr()
    assert err == "a line of someone else's\n"


def test_a_step_that_raises_leaves_neither_the_profiler_on_nor_stderr_borrowed(capfd):
    """The meter borrows fd 2 for its window; a step that raises inside it (a lost peer, a bug) abandons the
    meter (the trainer's run_schedule), and stderr is the terminal's again, the profiler off."""
    import os

    from torch.autograd import _profiler_enabled

    before = os.fstat(2).st_ino
    meter = PeakMeter().start()
    assert os.fstat(2).st_ino != before and _profiler_enabled()
    meter.abandon()
    assert os.fstat(2).st_ino == before and not _profiler_enabled()
    os.write(2, b"after the failed step\n")
    assert capfd.readouterr().err == "after the failed step\n"
    meter.abandon()  # twice, or after a stop: nothing more to undo
