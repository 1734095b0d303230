"""One pipeline lane's point-to-point traffic and the autograd steps around it, for every pipeline schedule.

No shape header: every rank knows each micro-batch's activation shape from
the plan (tokens, or tokens / tp under SP, by hidden), so it allocates the
receive buffer itself. Plain 1F1B pairs each send with the receive its next
step needs in one batched call (`send_recv`); interleaved 1F1B exchanges what
one lockstep tick made in one batched call (`exchange`, interleaved.py).
Batched, sends and receives pair up on every backend: alone, an NCCL send
blocks its stream until the peer receives.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from hydraulis.runtime.modeling.model import StageModel
from hydraulis.runtime.parallelism.batch import MicroBatchInput
from hydraulis.runtime.parallelism.groups import ReplicaGroups


class LaneP2P:
    """P2p along one pipeline lane (global ranks, on the lane's group)."""

    def __init__(self, groups: ReplicaGroups, device: torch.device, dtype: torch.dtype, hidden: int):
        self.device = device
        self.dtype = dtype
        self.hidden = hidden
        self.group = groups.pp_group
        self.tp = groups.tp

    def shape(self, batch: MicroBatchInput) -> tuple[int, int]:
        tokens = batch.num_tokens // self.tp.size if self.tp.sequence_parallel else batch.num_tokens
        return tokens, self.hidden

    def send_recv(
        self,
        send: torch.Tensor | None,
        send_to: int | None,
        recv_from: int | None,
        recv_batch: MicroBatchInput | None = None,
    ) -> torch.Tensor | None:
        """One `exchange`: a send, a receive of `recv_batch`'s activation shape, or both; the received tensor."""
        sends = [(send, send_to)] if send is not None and send_to is not None else []
        received = self.exchange(sends, [(recv_from, recv_batch)] if recv_from is not None else [])
        return received[0] if received else None

    def exchange(
        self, sends: Sequence[tuple[torch.Tensor, int]], receives: Sequence[tuple[int, MicroBatchInput]]
    ) -> list[torch.Tensor]:
        """Sends (tensor, to) and receives (from, of `batch`'s activation shape) in one batch, waited whole; the
        received tensors in order. Each pair of ranks has at most one transfer each way in it."""
        into = [torch.empty(self.shape(b), dtype=self.dtype, device=self.device) for _, b in receives]
        ops = [dist.P2POp(dist.isend, t.contiguous(), to, group=self.group) for t, to in sends]
        ops += [dist.P2POp(dist.irecv, buf, source, group=self.group) for buf, (source, _) in zip(into, receives,
                                                                                                strict=True)]
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        return into


class LossShares:
    """The head's side of a step, under every schedule: each micro-batch's share of the global mean loss (its sum of
    token losses over the global batch's targets, what its backward starts from) and the sum of token losses so
    far, a tensor (no device sync)."""

    def __init__(self, num_global_targets: int, device: torch.device):
        self.num_global_targets = num_global_targets
        self.sum = torch.zeros((), dtype=torch.float32, device=device)

    def share(self, model: StageModel, x: torch.Tensor | None, batch: MicroBatchInput) -> torch.Tensor:
        """The last virtual stage's forward of one micro-batch to its loss share; its token losses added to `sum`."""
        token_loss_sum = model.loss_sum(x, batch)
        self.sum = self.sum + token_loss_sum.detach()
        return token_loss_sum / self.num_global_targets


def deallocate_output(out: torch.Tensor) -> None:
    """Free a sent stage output's storage but keep its autograd node (Megatron's deallocate_output_tensor).

    The next stage holds its own copy; this stage needs only the graph behind
    the output for its backward, which `backward_from` runs without the
    shape check that the freed tensor would fail. A detached tensor that
    waits to be sent keeps the storage until it is.
    """
    out.data = torch.empty((1,), device=out.device, dtype=out.dtype)


def backward_from(out: torch.Tensor, grad: torch.Tensor) -> None:
    from torch.autograd.variable import Variable

    Variable._execution_engine.run_backward(
        tensors=(out,),
        grad_tensors=(grad,),
        keep_graph=False,
        create_graph=False,
        inputs=(),
        allow_unreachable=True,
        accumulate_grad=True,
    )
