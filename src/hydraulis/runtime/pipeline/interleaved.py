"""Interleaved 1F1B (vp model chunks per pipeline rank) for micro-batches of different lengths.

Chunk c of stage s is virtual stage c * pp + s (Megatron's layout, model.py's
`chunk_layers`): a micro-batch goes through stages 0..pp-1 with chunk 0, then
from the last stage back to the first with chunk 1, and so on. Each rank runs
`pipeline_order.interleaved_order`, the one order the simulator times (Megatron's
schedule table and micro-batch groups), so simulation and runtime run one order.

The stages go in lockstep ticks (`lockstep`): in a tick each stage runs at most
its next event, once what it waits for came out of an earlier tick; between
two ticks every activation or gradient made in the tick before goes to its
stage in one batched p2p call per rank, which every rank derives from the plan
alone, so sends and receives pair up within the tick on every backend (NCCL
too, where a lone send would block its stream) and no shape travels. A value
that arrives before its event keeps until the event runs.

Zero-bubble (`train_step(deferred=...)`, any vp, 1 included): each backward is a
B that keeps its linears' weight gradients (parallelism/weight_grad.py), and the
W's placed after a stage's event run after that tick's exchange, oldest first,
so the B's input gradient leaves before its W computes.
"""

from __future__ import annotations

import functools
from collections import Counter, deque
from collections.abc import Sequence

import torch

from hydraulis.pipeline_order import FORWARD, WEIGHT, event_graph, stage_order, with_weights
from hydraulis.runtime.modeling.model import StageModel
from hydraulis.runtime.parallelism.batch import MicroBatchInput
from hydraulis.runtime.parallelism.groups import ReplicaGroups, lane_ranks
from hydraulis.runtime.parallelism.weight_grad import WeightGradStore
from hydraulis.runtime.pipeline.lane import LaneP2P, LossShares, backward_from, deallocate_output

Event = tuple[int, int, int]  # (FORWARD or BACKWARD, micro-batch, chunk)


@functools.lru_cache(maxsize=256)
def lockstep(pp: int, vp: int, micro_batches: int) -> tuple[tuple[Event | None, ...], ...]:
    """Per tick, each stage's event (None: it waits): every stage in its `stage_order`, an event in the first tick
    after its stage's previous event and after the one that made its input (the simulator's `event_graph`, each
    event one tick long)."""
    g = event_graph(pp, vp, micro_batches)
    tick = [0] * len(g.stage)
    for e, (p, d) in enumerate(zip(g.prev, g.dep, strict=True)):  # the graph's order: p and d come before e
        tick[e] = max(tick[p] + 1 if p >= 0 else 0, tick[d] + 1 if d >= 0 else 0)
    rows: list[list[Event | None]] = [[None] * pp for _ in range(max(tick, default=-1) + 1)]
    for e, t in enumerate(tick):
        rows[t][g.stage[e]] = (g.kind[e], g.micro_batch[e], g.chunk[e])
    return tuple(tuple(row) for row in rows)


def message(pp: int, vp: int, stage: int, event: Event) -> tuple[int, Event] | None:
    """The stage an event's output goes to and the event there that takes it; None: it sends nothing (the
    first virtual stage's backward, the last one's forward)."""
    kind, j, chunk = event
    virtual = chunk * pp + stage
    if kind == FORWARD:
        if virtual == pp * vp - 1:
            return None
        to = virtual + 1
    else:
        if virtual == 0:
            return None
        to = virtual - 1
    return to % pp, (kind, j, to // pp)


class InterleavedRun:
    """One rank's run of one step under interleaved 1F1B: its micro-batches in flight per chunk, the values
    received ahead of their events, the order as run, the loss so far (on the rank whose last chunk holds the
    head)."""

    def __init__(
        self, model: StageModel, groups: ReplicaGroups, micro_batches: Sequence[MicroBatchInput],
        num_global_targets: int, store: WeightGradStore | None = None, deferred: Sequence[int] = (),
    ):
        param = next(model.parameters())
        config = groups.config
        self.model = model
        self.pp = config.pp
        self.vp = config.vp
        self.stage = groups.stage
        self.lane = lane_ranks(config, groups.ranks, groups.tp.rank, groups.cp.rank)  # global rank of each stage
        self.p2p = LaneP2P(groups, param.device, param.dtype, model.spec.hidden)
        self.batches = [b.to(param.device) for b in micro_batches]
        self.in_flight: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor]] = {}  # (j, c): input, output
        self.inbox: dict[Event, torch.Tensor] = {}  # received activations (forward) and gradients (backward)
        self.outbox: torch.Tensor | None = None  # what this tick's event sends
        self.order: list[Event] = []
        self.loss = LossShares(num_global_targets, param.device)
        # Deferred W's (zero-bubble; none without `deferred`): the store the B's keep them in, the W events to
        # come, oldest first, how many go after each of this stage's events (by index) and how many are due now.
        self.store = store if deferred else None
        order = stage_order(self.pp, self.vp, len(self.batches), self.stage) if deferred else ()
        self.weights = deque(e for e in with_weights(order, deferred) if e[0] == WEIGHT)
        self.after = Counter(deferred)
        self.ran = self.due = 0

    def run(self) -> None:
        """Every tick of `lockstep`: the values of the tick before exchanged, then the W's due after this stage's
        event of that tick (its gradient already sent), then this stage's event."""
        ticks = lockstep(self.pp, self.vp, len(self.batches))
        for t, row in enumerate(ticks):
            if t:
                self._exchange(ticks[t - 1])
                self._run_weights()
            event = row[self.stage]
            if event is not None:
                self.order.append(event)
                (self._forward if event[0] == FORWARD else self._backward)(event)
                self.due += self.after[self.ran]
                self.ran += 1
        self._exchange(ticks[-1])
        self._run_weights()

    def _run_weights(self) -> None:
        """The W's placed after this stage's last event, oldest first."""
        for _ in range(self.due):
            self.store.run_oldest()
            self.order.append(self.weights.popleft())
        self.due = 0

    def _exchange(self, row: tuple[Event | None, ...]) -> None:
        """Send what this stage's event of `row` made, receive what its neighbours' made for it; one batch."""
        sends, receives, keys = [], [], []
        mine = None if row[self.stage] is None else message(self.pp, self.vp, self.stage, row[self.stage])
        if mine is not None:
            sends.append((self.outbox, self.lane[mine[0]]))
        self.outbox = None
        for peer in sorted({(self.stage - 1) % self.pp, (self.stage + 1) % self.pp} - {self.stage}):
            sent = None if row[peer] is None else message(self.pp, self.vp, peer, row[peer])
            if sent is not None and sent[0] == self.stage:
                receives.append((self.lane[peer], self.batches[sent[1][1]]))
                keys.append(sent[1])
        for key, value in zip(keys, self.p2p.exchange(sends, receives), strict=True):
            self.inbox[key] = value

    def _forward(self, event: Event) -> None:
        """Micro-batch j through chunk c; its output to send, or (last virtual stage) its loss share kept."""
        _, j, chunk = event
        batch = self.batches[j]
        virtual = chunk * self.pp + self.stage
        x = None if virtual == 0 else self.inbox.pop(event).requires_grad_()
        if virtual == self.pp * self.vp - 1:  # (pp = vp = 1: on the tokens)
            out = self.loss.share(self.model, batch.tokens if x is None else x, batch)
        else:
            out = self.model(batch.tokens if x is None else x, batch, chunk)
            self.outbox = out.detach()
            deallocate_output(out)  # the detached tensor keeps the storage until it is sent
        self.in_flight[j, chunk] = (x, out)

    def _backward(self, event: Event) -> None:
        """Micro-batch j's backward through chunk c; the gradient of its input to send."""
        _, j, chunk = event
        x, out = self.in_flight.pop((j, chunk))
        grad = None if chunk * self.pp + self.stage == self.pp * self.vp - 1 else self.inbox.pop(event)
        if self.store is None:
            _backward(out, grad)
        else:  # B: the weight gradients kept for a W
            with self.store.collect():
                _backward(out, grad)
        self.outbox = None if x is None else x.grad


def _backward(out: torch.Tensor, grad: torch.Tensor | None) -> None:
    """A chunk's backward from its output: the last virtual stage's from its loss share (`grad` None)."""
    if grad is None:
        out.backward()
    else:
        backward_from(out, grad)


@torch.no_grad()
def forward_chunks(
    model: StageModel, groups: ReplicaGroups, micro_batches: Sequence[MicroBatchInput]
) -> torch.Tensor | None:
    """Forward only (evaluation): each micro-batch through every virtual stage in turn (each rank's chunks in
    order), each send waited for; the sum of token losses on the rank with the head (None elsewhere). Nothing is
    kept for backward; with vp = 1 it is plain receive, compute, send."""
    param = next(model.parameters())
    pp, vp, stage = groups.config.pp, groups.config.vp, groups.stage
    lane = lane_ranks(groups.config, groups.ranks, groups.tp.rank, groups.cp.rank)
    p2p = LaneP2P(groups, param.device, param.dtype, model.spec.hidden)
    total = torch.zeros((), dtype=torch.float32, device=param.device)
    for batch in (b.to(param.device) for b in micro_batches):
        for chunk in range(vp):
            virtual = chunk * pp + stage
            x = batch.tokens if virtual == 0 else p2p.send_recv(None, None, lane[(stage - 1) % pp], batch)
            if virtual == pp * vp - 1:
                total += model.loss_sum(x, batch)
            else:
                p2p.send_recv(model(x, batch, chunk), lane[(stage + 1) % pp], None)
    return total if model.has_head(vp - 1) else None
