"""The non-interleaved 1F1B executor, for micro-batches of different lengths.

`torch.distributed.pipelining` assumes one activation shape for every
micro-batch (and aborts the process otherwise); packed micro-batches differ
in length. Every rank knows each micro-batch's shape from the plan, so
receivers allocate exactly what comes, with no shape header.

The 1F1B order on stage s of pp, with M micro-batches (as Megatron-core's
non-interleaved 1F1B):

- warm-up: min(pp - s - 1, M) forwards;
- steady state: one forward, one backward, until every forward is done;
- cool-down: the remaining backwards.

A forward's send and the next backward's receive go in one batched p2p
call, `send_recv` (and a backward's send with the next forward's receive), so paired
stages never wait on each other's sends (lane.py). A config with vp > 1 model
chunks per rank runs interleaved 1F1B instead (interleaved.py; step.py chooses).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import torch

from hydraulis.pipeline_order import BACKWARD, FORWARD, warmup_count
from hydraulis.runtime.modeling.model import StageModel
from hydraulis.runtime.parallelism.batch import MicroBatchInput
from hydraulis.runtime.parallelism.groups import ReplicaGroups
from hydraulis.runtime.pipeline.lane import LaneP2P, LossShares, backward_from, deallocate_output


def micro_batch_loss(model: StageModel, x: torch.Tensor, batch: MicroBatchInput) -> torch.Tensor:
    """The last stage's forward of one micro-batch to its sum of token losses (fp32 scalar), the head's
    logits computed in chunks of rows and never kept (cross_entropy.py)."""
    return model.loss_sum(x, batch)



class OneFOneBRun:
    """One stage's run of one step: its micro-batches in flight, the order as run, the loss so far."""

    def __init__(
        self, model: StageModel, groups: ReplicaGroups, micro_batches: Sequence[MicroBatchInput],
        num_global_targets: int,
    ):
        param = next(model.parameters())
        self.model = model
        self.groups = groups
        self.first = groups.is_first_stage
        self.last = groups.is_last_stage
        self.p2p = LaneP2P(groups, param.device, param.dtype, model.spec.hidden)
        self.batches = [b.to(param.device) for b in micro_batches]
        self.warmup = warmup_count(groups.config.pp, 1, len(self.batches), groups.stage)
        self.in_flight: deque[tuple[int, torch.Tensor | None, torch.Tensor]] = deque()  # (micro-batch, input, output)
        self.order: list[tuple[int, int]] = []
        self.loss = LossShares(num_global_targets, param.device)
        self.next_forward = 0

    def warm_up(self) -> None:
        """Forwards only, as many as stages below this one, so the last stage starts its first backward."""
        for _ in range(self.warmup):
            x = self._recv_forward()
            y = self._forward(x)
            if not self.last:
                self.p2p.send_recv(y.detach(), self.groups.next_rank, None)
                deallocate_output(y)

    def steady_state(self) -> None:
        """One forward, one backward; each send is paired with the receive the next step needs."""
        groups, count = self.groups, len(self.batches)
        x = self._recv_forward() if count > self.warmup else None
        for i in range(count - self.warmup):
            y = self._forward(x)
            # Send this forward's output and receive the gradient for the oldest in-flight micro-batch.
            grad_out = None
            if not self.last:
                oldest = self.batches[self.in_flight[0][0]]
                grad_out = self.p2p.send_recv(y.detach(), groups.next_rank, groups.next_rank, oldest)
                deallocate_output(y)
            grad_in = self._backward(grad_out)
            # Send the input gradient back and receive the next forward's input (none after the last).
            final = i == count - self.warmup - 1
            if not self.first:
                nxt = None if final else self.batches[self.next_forward]
                x = self.p2p.send_recv(grad_in, groups.prev_rank, None if final else groups.prev_rank, nxt)

    def cool_down(self) -> None:
        """The backwards of the warm-up's forwards."""
        groups = self.groups
        for _ in range(self.warmup):
            oldest = self.batches[self.in_flight[0][0]]
            grad_out = None if self.last else self.p2p.send_recv(None, None, groups.next_rank, oldest)
            grad_in = self._backward(grad_out)
            if not self.first:
                self.p2p.send_recv(grad_in, groups.prev_rank, None)

    def _recv_forward(self) -> torch.Tensor | None:
        if self.first:
            return None
        return self.p2p.send_recv(None, None, self.groups.prev_rank, self.batches[self.next_forward])

    def _forward(self, x: torch.Tensor | None) -> torch.Tensor:
        """The next micro-batch's forward; on the last stage, its share of the global mean loss."""
        index, batch = self.next_forward, self.batches[self.next_forward]
        self.next_forward += 1
        self.order.append((FORWARD, index))
        if self.first:
            x = batch.tokens
        else:
            x.requires_grad_()
        out = self.loss.share(self.model, x, batch) if self.last else self.model(x, batch)
        self.in_flight.append((index, None if self.first else x, out))
        return out

    def _backward(self, grad_out: torch.Tensor | None) -> torch.Tensor | None:
        """The oldest in-flight micro-batch's backward; returns the gradient of its input (None on stage 0)."""
        index, x, out = self.in_flight.popleft()
        self.order.append((BACKWARD, index))
        if self.last:
            out.backward()
        else:
            backward_from(out, grad_out)
        return None if x is None else x.grad
