"""Deferred weight gradients (zero-bubble W's, runtime/parallelism/weight_grad.py) in one process: any placement of a
stage's W's gives the fused backward's gradients bit for bit, and the step runs the order `with_weights` gives."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from hydraulis.cost.policies import MemoryPolicy
from hydraulis.errors import HydraulisError
from hydraulis.pipeline_order import BACKWARD, WEIGHT, stage_order, with_weights
from hydraulis.runtime import StageModel, concatenate_documents, count_targets, single_process_groups, train_step
from hydraulis.runtime.modeling.main_grad import attach_main_grads, gradient
from hydraulis.runtime.optimizer.layout import reset_parameters
from hydraulis.specs import MODELS

LENGTHS = ([11, 4], [19, 7, 2], [15], [6, 9], [23])


def random_slots(order, rng: np.random.Generator) -> list[int]:
    """Each W anywhere from its own B to the end, nondecreasing."""
    slots, low = [], 0
    for i, event in enumerate(order):
        if event[0] == BACKWARD:
            low = max(low, i)
            low = int(rng.integers(low, len(order)))
            slots.append(low)
    return slots


def step(slots, dtype=torch.float32, policies=(0,)):
    spec = MODELS["tiny"]
    g = torch.Generator().manual_seed(5)
    docs = [[torch.randint(0, spec.vocab, (n,), generator=g) for n in mb] for mb in LENGTHS]
    batches = [dataclasses.replace(concatenate_documents(d), policy=int(policies[k % len(policies)]))
               for k, d in enumerate(docs)]
    model = StageModel(spec, dtype=dtype)
    reset_parameters(model, 11)
    if dtype != torch.float32:
        attach_main_grads(model)
    result = train_step(model, single_process_groups(), batches, count_targets([n for mb in LENGTHS for n in mb]),
                        deferred=slots)
    return result, {n: gradient(p)[0].clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize(("dtype", "policies"), [(torch.float32, (MemoryPolicy.NONE, MemoryPolicy.FULL,
                                                                  MemoryPolicy.SELECTIVE)),
                                                 (torch.bfloat16, (MemoryPolicy.NONE,))])
def test_deferred_weight_gradients_equal_the_fused_ones_bit_for_bit_wherever_they_run(dtype, policies):
    order = stage_order(1, 1, len(LENGTHS), 0)
    own = [i for i, e in enumerate(order) if e[0] == BACKWARD]
    fused, want = step((), dtype, policies)
    rng = np.random.default_rng(3)
    for slots in (own, [len(order) - 1] * len(own), random_slots(order, rng), random_slots(order, rng)):
        result, got = step(slots, dtype, policies)
        assert result.order == with_weights(order, slots), slots
        assert sum(e[0] == WEIGHT for e in result.order) == len(own)
        assert result.loss == fused.loss
        for name, g in want.items():
            assert torch.equal(got[name], g), (slots, name)


def test_weight_slots_out_of_order_are_refused_before_the_step():
    order = stage_order(1, 1, len(LENGTHS), 0)
    own = [i for i, e in enumerate(order) if e[0] == BACKWARD]
    late = [own[0], own[2], own[1], *own[3:]]  # not nondecreasing
    for bad in (own[:-1], [own[0] - 1, *own[1:]], late, [*own[:-1], len(order)]):
        with pytest.raises(HydraulisError, match="weight slot"):
            step(bad)


@pytest.mark.parametrize(("pp", "vp", "m"), [(2, 1, 3), (2, 2, 3), (4, 2, 5), (3, 3, 4)])
def test_with_weights_places_each_w_after_its_own_backward_oldest_first(pp, vp, m):
    """Each stage's B's and W's pair up in order (FIFO), every W at its slot: right after its B when fused, all
    after the last event at the end; the F's and B's keep the stage's order."""
    for stage in range(pp):
        order = stage_order(pp, vp, m, stage)
        backwards = [i for i, e in enumerate(order) if e[0] == BACKWARD]
        for slots in (backwards, [len(order) - 1] * len(backwards), random_slots(order, np.random.default_rng(m))):
            full = with_weights(order, slots)
            assert [e for e in full if e[0] != WEIGHT] == list(order)
            ws = [e[1:] for e in full if e[0] == WEIGHT]
            assert ws == [order[i][1:] for i in backwards]  # the i-th W is the i-th B's
            events = [i for i, e in enumerate(full) if e[0] != WEIGHT]  # where each of `order`'s events went
            for k, (at, slot) in enumerate(zip(backwards, slots, strict=True)):
                place = [i for i, e in enumerate(full) if e[0] == WEIGHT][k]
                assert events[slot] < place < (events[slot + 1] if slot + 1 < len(order) else len(full))
                assert events[at] < place
    assert with_weights(order, ()) == order
