"""Interleaved 1F1B (vp model chunks per pipeline rank) for micro-batches of different lengths.

Chunk c of stage s is virtual stage c * pp + s (Megatron's layout, model.py's
`chunk_layers`): a micro-batch goes through stages 0..pp-1 with chunk 0, then
from the last stage back to the first with chunk 1, and so on. Each rank runs
`planner.sim.interleaved_order`, the one order the simulator times (Megatron's
schedule table and micro-batch groups), so simulation and runtime run one order.

Every receive knows its shape from the plan (lane.py), so no shape travels.
Sends are posted and not waited for; a rank waits only for what it receives,
and the order is free of cycles (the simulator's sweep fails on one), so no
rank waits forever. Activations and gradients between the same two ranks
travel under their own tags, each in the order both ends run their events
(a send's order on one rank is its receive's on the other).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hydraulis.parallel import FORWARD
from hydraulis.planner.sim import interleaved_order
from hydraulis.runtime.lane import ACTIVATION_TAG, GRADIENT_TAG, LaneP2P, backward_from, deallocate_output
from hydraulis.runtime.modeling.model import StageModel
from hydraulis.runtime.parallelism.batch import MicroBatchInput
from hydraulis.runtime.parallelism.groups import ReplicaGroups, lane_ranks


def virtual_neighbours(groups: ReplicaGroups) -> tuple[int, int]:
    """(previous, next) rank of this rank's lane, wrapping around: the last stage's chunk c feeds the first
    stage's chunk c + 1."""
    config, stage = groups.config, groups.stage
    lane = lane_ranks(config, groups.ranks, groups.tp.rank, groups.cp.rank)
    return lane[(stage - 1) % config.pp], lane[(stage + 1) % config.pp]


class InterleavedRun:
    """One rank's run of one step under interleaved 1F1B: its micro-batches in flight per chunk, the order as
    run, the loss so far (on the rank whose last chunk holds the head)."""

    def __init__(
        self, model: StageModel, groups: ReplicaGroups, micro_batches: Sequence[MicroBatchInput],
        num_global_targets: int,
    ):
        param = next(model.parameters())
        self.model = model
        self.num_global_targets = num_global_targets
        self.pp = groups.config.pp
        self.vp = groups.config.vp
        self.stage = groups.stage
        self.prev_rank, self.next_rank = virtual_neighbours(groups)
        self.p2p = LaneP2P(groups, param.device, param.dtype, model.spec.hidden)
        self.batches = [b.to(param.device) for b in micro_batches]
        self.in_flight: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor]] = {}  # (j, c): input, output
        self.order: list[tuple[int, int, int]] = []
        self.loss_sum = torch.zeros((), dtype=torch.float32, device=param.device)

    def run(self) -> None:
        """Every event of the simulator's order in turn; then every send waited for."""
        for kind, j, chunk in interleaved_order(self.pp, self.vp, len(self.batches), self.stage):
            self.order.append((kind, j, chunk))
            if kind == FORWARD:
                self._forward(j, chunk)
            else:
                self._backward(j, chunk)
        self.p2p.finish_sends()

    def _first(self, chunk: int) -> bool:
        return chunk * self.pp + self.stage == 0

    def _last(self, chunk: int) -> bool:
        return chunk * self.pp + self.stage == self.pp * self.vp - 1

    def _forward(self, j: int, chunk: int) -> None:
        """Micro-batch j through chunk `chunk`; its output sent on, or (last virtual stage) its loss share kept."""
        batch = self.batches[j]
        x = None
        if not self._first(chunk):
            x = self.p2p.recv(self.prev_rank, batch, ACTIVATION_TAG).requires_grad_()
        if self._last(chunk):
            token_loss_sum = self.model.loss_sum(x, batch)
            self.loss_sum = self.loss_sum + token_loss_sum.detach()
            out = token_loss_sum / self.num_global_targets
        else:
            out = self.model(batch.tokens if x is None else x, batch, chunk)
            self.p2p.post_send(out.detach(), self.next_rank, ACTIVATION_TAG)
            deallocate_output(out)
        self.in_flight[j, chunk] = (x, out)

    def _backward(self, j: int, chunk: int) -> None:
        """Micro-batch j's backward through chunk `chunk`; the gradient of its input sent back."""
        x, out = self.in_flight.pop((j, chunk))
        if self._last(chunk):
            out.backward()
        else:
            backward_from(out, self.p2p.recv(self.next_rank, self.batches[j], GRADIENT_TAG))
        if x is not None:
            self.p2p.post_send(x.grad, self.prev_rank, GRADIENT_TAG)


@torch.no_grad()
def forward_chunks(
    model: StageModel, groups: ReplicaGroups, micro_batches: Sequence[MicroBatchInput]
) -> torch.Tensor | None:
    """Forward only (evaluation): each micro-batch through every virtual stage in turn, so each rank's chunks in
    order; the sum of token losses on the rank with the head (None elsewhere). Nothing is kept for backward."""
    param = next(model.parameters())
    run = InterleavedRun(model, groups, micro_batches, 1)
    total = torch.zeros((), dtype=torch.float32, device=param.device)
    for batch in run.batches:
        for chunk in range(run.vp):
            x = batch.tokens if run._first(chunk) else run.p2p.recv(run.prev_rank, batch, ACTIVATION_TAG)
            if run._last(chunk):
                total += model.loss_sum(x, batch)
            else:
                run.p2p.post_send(model(x, batch, chunk), run.next_rank, ACTIVATION_TAG)
    run.p2p.finish_sends()
    return total if model.has_head(run.vp - 1) else None
