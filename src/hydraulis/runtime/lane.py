"""One pipeline lane's point-to-point traffic and the autograd steps around it, for every pipeline schedule.

No shape header: every rank knows each micro-batch's activation shape from
the plan (tokens, or tokens / tp under SP, by hidden), so it allocates the
receive buffer itself. Plain 1F1B pairs each send with the receive its next
step needs in one batched call (`send_recv`); interleaved 1F1B posts each
send on its own and goes on (`post_send`), so a rank waits only for what it
receives, and a tag keeps activations and gradients that travel between the
same two ranks apart (with pp = 2, or on the wrap from the last stage to the
first, both directions carry both).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hydraulis.runtime.parallelism.batch import MicroBatchInput
from hydraulis.runtime.parallelism.groups import ReplicaGroups

ACTIVATION_TAG, GRADIENT_TAG = 0, 1


class LaneP2P:
    """P2p along one pipeline lane (global ranks, on the lane's group)."""

    def __init__(self, groups: ReplicaGroups, device: torch.device, dtype: torch.dtype, hidden: int):
        self.device = device
        self.dtype = dtype
        self.hidden = hidden
        self.group = groups.pp_group
        self.tp = groups.tp
        self.pending: list[tuple[dist.Work, torch.Tensor]] = []  # posted sends and the tensors they read

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
        """One batch: a send, a receive of `recv_batch`'s activation shape, or both; waited whole."""
        send_to = send_to if send is not None else None
        into = None
        if recv_from is not None:
            into = torch.empty(self.shape(recv_batch), dtype=self.dtype, device=self.device)
        ops = []
        if send_to is not None:
            ops.append(dist.P2POp(dist.isend, send.contiguous(), send_to, group=self.group))
        if into is not None:
            ops.append(dist.P2POp(dist.irecv, into, recv_from, group=self.group))
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        return into

    def post_send(self, tensor: torch.Tensor, to: int, tag: int) -> None:
        """Send without waiting; the tensor is kept until the send completed (`finish_sends`, or a later post)."""
        self.pending = [(w, t) for w, t in self.pending if not w.is_completed()]
        tensor = tensor.contiguous()
        self.pending.append((dist.isend(tensor, to, group=self.group, tag=tag), tensor))

    def recv(self, source: int, batch: MicroBatchInput, tag: int) -> torch.Tensor:
        """`batch`'s activation (or its gradient) from `source`, waited for."""
        into = torch.empty(self.shape(batch), dtype=self.dtype, device=self.device)
        dist.irecv(into, source, group=self.group, tag=tag).wait()
        return into

    def finish_sends(self) -> None:
        for work, _ in self.pending:
            work.wait()
        self.pending = []


def deallocate_output(out: torch.Tensor) -> None:
    """Free a sent stage output's storage but keep its autograd node (Megatron's deallocate_output_tensor).

    The next stage holds its own copy; this stage needs only the graph behind
    the output for its backward, which `backward_from` runs without the
    shape check that the freed tensor would fail. A send still in flight
    holds the detached tensor it reads, which keeps the storage until it is done.
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
