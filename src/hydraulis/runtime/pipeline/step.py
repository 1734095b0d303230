"""A replica's step through its pipeline: `train_step` (1F1B, or interleaved 1F1B with vp > 1 chunks per
rank) and `forward_step` (evaluation), with the checks every rank makes before any communication.

Gradients accumulate in `.grad` across micro-batches; each micro-batch's loss is its sum of token losses
divided by the real targets of the WHOLE global batch, so the accumulated gradient equals single-device
training on that batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hydraulis.errors import HydraulisError
from hydraulis.pipeline_order import slots_error, stage_order
from hydraulis.runtime.modeling.model import StageModel
from hydraulis.runtime.parallelism.batch import MicroBatchInput
from hydraulis.runtime.parallelism.groups import ReplicaGroups
from hydraulis.runtime.parallelism.weight_grad import deferral
from hydraulis.runtime.pipeline.interleaved import InterleavedRun, forward_chunks
from hydraulis.runtime.pipeline.one_f_one_b import OneFOneBRun


@dataclass(frozen=True)
class StepResult:
    """What one rank learns from a step; the loss is known on the last stage only."""

    loss_sum_tensor: torch.Tensor | None  # sum of token losses (last stage); a tensor, so no device sync here
    num_targets: int  # real targets of this replica's micro-batches
    num_global_targets: int
    # (FORWARD or BACKWARD, micro-batch) as run, equal to pipeline_order.one_f_one_b_order; interleaved (vp > 1):
    # (kind, micro-batch, chunk), pipeline_order.interleaved_order; deferred: with (WEIGHT, micro-batch, chunk)
    # events, pipeline_order.with_weights (3-tuples at vp = 1 too)
    order: tuple[tuple[int, ...], ...]

    @property
    def loss_sum(self) -> float | None:
        return None if self.loss_sum_tensor is None else float(self.loss_sum_tensor)

    @property
    def loss(self) -> float | None:
        """This replica's share of the global mean loss; shares of all replicas add up to it."""
        return None if self.loss_sum is None else self.loss_sum / self.num_global_targets


def train_step(
    model: StageModel,
    groups: ReplicaGroups,
    micro_batches: Sequence[MicroBatchInput],
    num_global_targets: int,
    reduce_partial_grads: bool = True,
    deferred: Sequence[int] = (),
) -> StepResult:
    """Forward and backward of this replica's micro-batches in 1F1B order; gradients add into `.grad`.

    Every rank of the replica calls it with the same micro-batches in execution
    order. The caller zeroes gradients before an iteration and steps the
    optimizer after it; several calls in between accumulate exactly. A
    replica without micro-batches returns at once (no communication), and
    its gradients stay untouched. `reduce_partial_grads=False` leaves partial
    gradients (SP norms, replicated KV heads) unsummed over the TP group, for
    a caller whose gradient reduce sums them anyway (the sharded optimizer).
    `deferred`: this stage's zero-bubble W slots (`pipeline_order.with_weights`), the linears' weight gradients
    of each backward run after the event they name (weight_grad.py), through the lockstep executor at any vp;
    the gradients equal a fused backward's. Empty: fused.
    """
    _check_step(model, groups, micro_batches, num_global_targets, deferred)
    if not micro_batches:
        return StepResult(None, 0, num_global_targets, ())
    stashed = model.stash_partial_grads() if reduce_partial_grads else None
    if deferred:
        with deferral() as store:
            stage = InterleavedRun(model, groups, micro_batches, num_global_targets, store=store, deferred=deferred)
            stage.run()
    elif groups.config.vp > 1:
        stage = InterleavedRun(model, groups, micro_batches, num_global_targets)
        stage.run()
    else:
        stage = OneFOneBRun(model, groups, micro_batches, num_global_targets)
        stage.warm_up()
        stage.steady_state()
        stage.cool_down()
    if reduce_partial_grads:
        model.finish_grads(stashed)
    return StepResult(
        loss_sum_tensor=stage.loss.sum if groups.is_last_stage else None,  # the head: the last stage's last chunk
        num_targets=sum(b.num_targets for b in micro_batches),
        num_global_targets=num_global_targets,
        order=tuple(stage.order),
    )


def forward_step(
    model: StageModel, groups: ReplicaGroups, micro_batches: Sequence[MicroBatchInput]
) -> torch.Tensor | None:
    """Forward only (evaluation): each micro-batch through the (virtual) stages in order; the last stage's sum of
    token losses (None elsewhere). No activation is kept, so stages need no schedule beyond receive, compute, send."""
    if not micro_batches:
        return None
    return forward_chunks(model, groups, micro_batches)


def _check_step(
    model: StageModel, groups: ReplicaGroups, micro_batches: Sequence[MicroBatchInput], num_global_targets: int,
    deferred: Sequence[int] = (),
) -> None:
    """Reject a step before any communication, so every rank of the replica fails alike instead of hanging."""
    if num_global_targets <= 0:
        raise HydraulisError(f"the global batch has {num_global_targets} target tokens; it needs at least one")
    config = groups.config
    if (model.stage, model.num_stages, model.vp) != (groups.stage, config.pp, config.vp):
        raise HydraulisError(f"model is stage {model.stage} of {model.num_stages} with {model.vp} chunks, "
                             f"groups say {groups.stage} of {config.pp} with {config.vp}")
    tp = groups.tp
    if tp.sequence_parallel and any(b.num_tokens % tp.size for b in micro_batches):
        raise HydraulisError(
            f"sequence parallelism needs micro-batches of a multiple of tp={tp.size} tokens; "
            "pack them with pad_to_multiple=tp"
        )
    order = stage_order(config.pp, config.vp, len(micro_batches), groups.stage) if deferred else ()
    if deferred and (error := slots_error(order, deferred)) is not None:
        raise HydraulisError(f"stage {groups.stage}: {error}")
