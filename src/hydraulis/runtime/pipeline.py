"""An own 1F1B pipeline executor for micro-batches of different lengths.

`torch.distributed.pipelining` assumes one activation shape for every
micro-batch (and aborts the process otherwise); packed micro-batches differ
in length. Every rank knows each micro-batch's shape from the plan, so
receivers allocate exactly what comes, with no shape header.

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
from hydraulis.planner.sim import BACKWARD, FORWARD
from hydraulis.runtime.batch import PackedBatch
from hydraulis.runtime.groups import ReplicaGroups
from hydraulis.runtime.model import StageModel


@dataclass(frozen=True)
class StepResult:
    """What one rank learns from a step; the loss is known on the last stage only."""

    loss_sum_tensor: torch.Tensor | None  # sum of token losses (last stage); a tensor, so no device sync here
    num_targets: int  # real targets of this replica's micro-batches
    num_global_targets: int
    schedule: tuple[tuple[int, int], ...]  # (FORWARD or BACKWARD, micro-batch) as run; equals sim.one_f_one_b_order

    @property
    def loss_sum(self) -> float | None:
        return None if self.loss_sum_tensor is None else float(self.loss_sum_tensor)

    @property
    def loss(self) -> float | None:
        """This replica's share of the global mean loss; shares of all replicas add up to it."""
        return None if self.loss_sum is None else self.loss_sum / self.num_global_targets


def micro_batch_loss(model: StageModel, x: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
    """The last stage's forward of one micro-batch to its sum of token losses (fp32 scalar), the head's
    logits computed in chunks of rows and never kept (cross_entropy.py)."""
    return model.loss_sum(x, batch)


class _P2P:
    """P2p along one pipeline lane; the sends and receives of one step go in one batch.

    No shape header: every rank knows each micro-batch's activation shape
    from the plan (tokens, or tokens / tp under SP, by hidden), so it
    allocates the receive buffer itself.
    """

    def __init__(self, groups: ReplicaGroups, device: torch.device, dtype: torch.dtype, hidden: int):
        self.groups, self.device, self.dtype, self.hidden = groups, device, dtype, hidden
        self.group = groups.pp_group
        self.tp = groups.tp

    def shape(self, batch: PackedBatch) -> tuple[int, int]:
        tokens = batch.num_tokens // self.tp.size if self.tp.sequence_parallel else batch.num_tokens
        return tokens, self.hidden

    def exchange(
        self,
        send: torch.Tensor | None,
        send_to: int | None,
        recv_from: int | None,
        recv_batch: PackedBatch | None = None,
    ) -> torch.Tensor | None:
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


def deallocate_output(out: torch.Tensor) -> None:
    """Free a sent stage output's storage but keep its autograd node (Megatron's deallocate_output_tensor).

    The next stage holds its own copy; this stage needs only the graph behind
    the output for its backward, which `_backward_from` runs without the
    shape check that the freed tensor would fail.
    """
    out.data = torch.empty((1,), device=out.device, dtype=out.dtype)


def _backward_from(out: torch.Tensor, grad: torch.Tensor) -> None:
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


def train_step(
    model: StageModel,
    groups: ReplicaGroups,
    micro_batches: Sequence[PackedBatch],
    num_global_targets: int,
    reduce_partial_grads: bool = True,
) -> StepResult:
    """Forward and backward of this replica's micro-batches in 1F1B order; gradients add into `.grad`.

    Every rank of the replica calls it with the same micro-batches in execution
    order. The caller zeroes gradients before an iteration and steps the
    optimizer after it; several calls in between accumulate exactly. A
    replica without micro-batches returns at once (no communication), and
    its gradients stay untouched. `reduce_partial_grads=False` leaves partial
    gradients (SP norms, replicated KV heads) unsummed over the TP group, for
    a caller whose gradient reduce sums them anyway (the disaggregated optimizer).
    """
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
    first, last = groups.is_first_stage, groups.is_last_stage
    if not micro_batches:
        return StepResult(None, 0, num_global_targets, ())
    param = next(model.parameters())
    device = param.device
    stashed = model.stash_partial_grads() if reduce_partial_grads else None
    p2p = _P2P(groups, device, param.dtype, model.spec.hidden)
    batches = [b.to(device) for b in micro_batches]
    count = len(batches)
    warmup = min(groups.config.pp - groups.stage - 1, count)
    in_flight: deque[tuple[int, torch.Tensor | None, torch.Tensor]] = deque()  # (micro-batch, input, output)
    schedule: list[tuple[int, int]] = []
    loss_sum = torch.zeros((), dtype=torch.float32, device=device)
    next_forward = 0

    def recv_forward() -> torch.Tensor | None:
        return None if first else p2p.exchange(None, None, groups.prev_rank, batches[next_forward])

    def forward(x: torch.Tensor | None) -> torch.Tensor:
        nonlocal next_forward, loss_sum
        index, batch = next_forward, batches[next_forward]
        next_forward += 1
        schedule.append((FORWARD, index))
        if first:
            x = batch.tokens
        else:
            x.requires_grad_()
        if last:
            token_loss_sum = micro_batch_loss(model, x, batch)
            loss_sum = loss_sum + token_loss_sum.detach()
            out = token_loss_sum / num_global_targets
        else:
            out = model(x, batch)
        in_flight.append((index, None if first else x, out))
        return out

    def backward(grad_out: torch.Tensor | None) -> torch.Tensor | None:
        index, x, out = in_flight.popleft()
        schedule.append((BACKWARD, index))
        if last:
            out.backward()
        else:
            _backward_from(out, grad_out)
        return None if x is None else x.grad

    def send_forward(y: torch.Tensor) -> None:
        if not last:
            p2p.exchange(y.detach(), groups.next_rank, None)
            deallocate_output(y)

    for _ in range(warmup):
        send_forward(forward(recv_forward()))

    x = recv_forward() if count > warmup else None
    for i in range(count - warmup):
        y = forward(x)
        # Send this forward's output and receive the gradient for the oldest in-flight micro-batch.
        grad_out = None
        if not last:
            grad_out = p2p.exchange(y.detach(), groups.next_rank, groups.next_rank, batches[in_flight[0][0]])
            deallocate_output(y)
        grad_in = backward(grad_out)
        # Send the input gradient back and receive the next forward's input (none after the last).
        final = i == count - warmup - 1
        if not first:
            nxt = None if final else batches[next_forward]
            x = p2p.exchange(grad_in, groups.prev_rank, None if final else groups.prev_rank, nxt)

    for _ in range(warmup):
        grad_out = None if last else p2p.exchange(None, None, groups.next_rank, batches[in_flight[0][0]])
        grad_in = backward(grad_out)
        if not first:
            p2p.exchange(grad_in, groups.prev_rank, None)

    if reduce_partial_grads:
        model.finish_grads(stashed)
    return StepResult(
        loss_sum_tensor=loss_sum if last else None,
        num_targets=sum(b.num_targets for b in micro_batches),
        num_global_targets=num_global_targets,
        schedule=tuple(schedule),
    )
