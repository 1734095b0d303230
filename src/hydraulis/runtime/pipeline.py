"""An own 1F1B pipeline executor for micro-batches of different lengths.

`torch.distributed.pipelining` assumes one activation shape for every
micro-batch (and aborts the process otherwise); packed micro-batches differ
in length. Here every p2p transfer is preceded by a small shape header, so
the receiver allocates exactly what comes.

Schedule on stage s of pp, with M micro-batches (as Megatron-core's
non-interleaved 1F1B):

- warm-up: min(pp - s - 1, M) forwards;
- steady state: one forward, one backward, until every forward is done;
- cool-down: the remaining backwards.

A forward's send and the next backward's receive go in one batched p2p
exchange (and a backward's send with the next forward's receive), so paired
stages never wait on each other's sends. Gradients accumulate in `.grad`
across micro-batches; each micro-batch's loss is its sum of token losses
divided by the real targets of the WHOLE global batch, so the accumulated
gradient equals single-device training on that batch.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hydraulis.errors import HydraulisError
from hydraulis.runtime.batch import PackedBatch
from hydraulis.runtime.groups import ReplicaGroups
from hydraulis.runtime.model import StageModel
from hydraulis.runtime.tensor_parallel import vocab_parallel_cross_entropy
from hydraulis.sim import BACKWARD, FORWARD

HEADER_LEN = 6  # dtype code, ndim, up to 4 dims
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class StepResult:
    """What one rank learns from a step; the loss is known on the last stage only."""

    loss_sum: float | None  # sum of token losses over this replica's micro-batches
    num_targets: int  # real targets of this replica's micro-batches
    num_global_targets: int
    schedule: tuple[tuple[int, int], ...]  # (FORWARD or BACKWARD, micro-batch) as run; equals sim.one_f_one_b_order

    @property
    def loss(self) -> float | None:
        """This replica's share of the global mean loss; shares of all replicas add up to it."""
        return None if self.loss_sum is None else self.loss_sum / self.num_global_targets


def micro_batch_loss(model: StageModel, logits: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
    """Sum of token losses of one micro-batch (fp32 scalar), from this rank's vocab shard of the logits."""
    return vocab_parallel_cross_entropy(logits, batch.targets, model.vocab_start, model.tp).sum()


class _P2P:
    """Shape-headed p2p along one pipeline lane; sends and receives of one step go in one batch."""

    def __init__(self, groups: ReplicaGroups, device: torch.device):
        self.groups, self.device = groups, device
        self.group = groups.pp_group

    def exchange(self, send: torch.Tensor | None, send_to: int | None, recv_from: int | None) -> torch.Tensor | None:
        send_to = send_to if send is not None else None
        if send_to is None and recv_from is None:
            return None
        header_in = torch.empty(HEADER_LEN, dtype=torch.int64, device=self.device) if recv_from is not None else None
        header_out = _header(send, self.device) if send_to is not None else None
        self._run(header_out, send_to, header_in, recv_from)
        payload_in = _alloc(header_in, self.device) if header_in is not None else None
        self._run(send.contiguous() if send_to is not None else None, send_to, payload_in, recv_from)
        return payload_in

    def _run(self, out: torch.Tensor | None, dst: int | None, into: torch.Tensor | None, src: int | None) -> None:
        ops = []
        if out is not None:
            ops.append(dist.P2POp(dist.isend, out, dst, group=self.group))
        if into is not None:
            ops.append(dist.P2POp(dist.irecv, into, src, group=self.group))
        for work in dist.batch_isend_irecv(ops):
            work.wait()


def _header(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    if t.dim() > HEADER_LEN - 2:
        raise HydraulisError(f"pipeline: cannot send a {t.dim()}-D tensor")
    values = [_DTYPES.index(t.dtype), t.dim(), *t.shape]
    return torch.tensor(values + [0] * (HEADER_LEN - len(values)), dtype=torch.int64, device=device)


def _alloc(header: torch.Tensor, device: torch.device) -> torch.Tensor:
    code, ndim, *dims = header.tolist()
    return torch.empty(dims[:ndim], dtype=_DTYPES[code], device=device)


def train_step(
    model: StageModel,
    groups: ReplicaGroups,
    micro_batches: Sequence[PackedBatch],
    num_global_targets: int,
) -> StepResult:
    """Forward and backward of this replica's micro-batches in 1F1B order; gradients add into `.grad`.

    Every rank of the replica calls it with the same micro-batches in execution
    order. The caller zeroes gradients before an iteration and steps the
    optimizer after it; several calls in between accumulate exactly.
    """
    if not micro_batches:
        raise HydraulisError("train_step needs at least one micro-batch")
    if num_global_targets <= 0:
        raise HydraulisError(f"the global batch has {num_global_targets} target tokens; it needs at least one")
    if (model.stage, model.num_stages) != (groups.stage, groups.config.pp):
        raise HydraulisError(
            f"model is stage {model.stage} of {model.num_stages}, groups say {groups.stage} of {groups.config.pp}"
        )
    tp = groups.tp
    if tp.sequence_parallel and any(b.num_tokens % tp.size for b in micro_batches):
        # Checked before any communication, so every rank of the replica fails alike instead of hanging.
        raise HydraulisError(
            f"sequence parallelism needs micro-batches of a multiple of tp={tp.size} tokens; "
            "pack them with pad_to_multiple=tp"
        )
    device = next(model.parameters()).device
    stashed = model.stash_partial_grads()
    p2p = _P2P(groups, device)
    first, last = groups.is_first_stage, groups.is_last_stage
    batches = [b.to(device) for b in micro_batches]
    count = len(batches)
    warmup = min(groups.config.pp - groups.stage - 1, count)
    in_flight: deque[tuple[int, torch.Tensor | None, torch.Tensor]] = deque()  # (micro-batch, input, output)
    schedule: list[tuple[int, int]] = []
    loss_sum = torch.zeros((), dtype=torch.float32, device=device)
    next_forward = 0

    def recv_forward() -> torch.Tensor | None:
        return None if first else p2p.exchange(None, None, groups.prev_rank)

    def forward(x: torch.Tensor | None) -> torch.Tensor:
        nonlocal next_forward, loss_sum
        index, batch = next_forward, batches[next_forward]
        next_forward += 1
        schedule.append((FORWARD, index))
        if first:
            x = batch.tokens
        else:
            x.requires_grad_()
        out = model(x, batch)
        if last:
            token_loss_sum = micro_batch_loss(model, out, batch)
            loss_sum = loss_sum + token_loss_sum.detach()
            out = token_loss_sum / num_global_targets
        in_flight.append((index, None if first else x, out))
        return out

    def backward(grad_out: torch.Tensor | None) -> torch.Tensor | None:
        index, x, out = in_flight.popleft()
        schedule.append((BACKWARD, index))
        torch.autograd.backward(out, grad_tensors=None if last else grad_out)
        return None if x is None else x.grad

    def send_forward(y: torch.Tensor) -> None:
        if not last:
            p2p.exchange(y.detach(), groups.next_rank, None)

    for _ in range(warmup):
        send_forward(forward(recv_forward()))

    x = recv_forward() if count > warmup else None
    for i in range(count - warmup):
        y = forward(x)
        # Send this forward's output and receive the gradient for the oldest in-flight micro-batch.
        grad_out = None if last else p2p.exchange(y.detach(), groups.next_rank, groups.next_rank)
        grad_in = backward(grad_out)
        # Send the input gradient back and receive the next forward's input (none after the last).
        final = i == count - warmup - 1
        if not first:
            x = p2p.exchange(grad_in, groups.prev_rank, None if final else groups.prev_rank)

    for _ in range(warmup):
        grad_out = None if last else p2p.exchange(None, None, groups.next_rank)
        grad_in = backward(grad_out)
        if not first:
            p2p.exchange(grad_in, groups.prev_rank, None)

    model.finish_grads(stashed)
    return StepResult(
        loss_sum=float(loss_sum) if last else None,
        num_targets=sum(b.num_targets for b in micro_batches),
        num_global_targets=num_global_targets,
        schedule=tuple(schedule),
    )
