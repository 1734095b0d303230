"""The exchange, run beside compute: prefetched gathers, reduces issued from backward (whole, with overlap off).

An exchange plan's rounds (exchange_plan.py) go in model order, and at most two
are in flight at once, each in its own pair of half-bucket buffers:

- `GatherStream`: a layer's forward pre-hook asks for the rounds that hold
  its parameters (`need`); the stream completes them and keeps the next one
  in flight, so the gather of layer i + 1 runs while layer i computes
  (FSDP's forward prefetch). What the layers never ask for (other ranks'
  parameters this rank only owns) goes out at `finish`.
- `ReduceStream`: rounds go in reverse model order. A post-accumulate-grad
  hook counts each parameter's gradients; after the last micro-batch's, the
  parameter is *sealed*, and every round whose gradients are all sealed is
  sent while backward goes on into earlier layers (Megatron's
  overlap_grad_reduce). The first round waits until the stage's last
  `reduce_after` blocks are through backward, so that its buffers and the
  reduced gradient take memory their activations freed (cost/memory.py's
  `reduce_wait` chooses how many and counts them so). A hook never waits: it sends only into a free slot
  and retires only finished rounds, so a pipeline stage cannot block its
  neighbours' p2p; `finish` sends the rest.

Every rank issues the same rounds in the same order on the same group
(all gather rounds, then all reduce rounds), whenever its compute reaches
them, so the collectives match. Waiting inside forward is safe only without
p2p, so a pipelined replica gathers everything before its first micro-batch
(`Exchange.gather_ahead`). The owners add every round's contributions in
rank order, so overlapped and sequential exchanges give bit-identical results.

The model's hooks (`attach_exchange_hooks`) drive an `Exchange` only inside
`ExchangeHooks.exchanging` (a deployment part's `exchanging`), which always
clears it; outside it they do nothing. The streams run on the optimizer this
module imports; the optimizer does not import this module.

`exposed_s` is the time the training thread spent inside the exchange
(packing, unpacking, waiting): what compute did not hide. On CUDA it is
host time; a wait there only orders streams.
"""

from __future__ import annotations

import contextlib
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch.autograd.profiler import record_function

from hydraulis.errors import HydraulisError
from hydraulis.runtime.modeling.main_grad import Gradient, gradient
from hydraulis.runtime.optimizer.exchange_plan import EXCHANGE_WINDOW, ExchangePlan, ExchangeRound
from hydraulis.runtime.optimizer.sharded import ShardedOptimizer
from hydraulis.runtime.parallelism.collectives import wait_alone

DEPTH = 2  # rounds in flight: the one compute waits for and the next


class _Rounds(ABC):
    """One exchange's rounds on the optimizer's group: issued in order, at most DEPTH in flight, retired in order."""

    def __init__(self, opt: ShardedOptimizer, plan: ExchangePlan, kind: str, dtype: torch.dtype,
                 order: Sequence[int]) -> None:
        self.opt = opt
        self.plan = plan
        self.kind = kind
        self.order = tuple(order)  # round indices in issue order
        self.issued = 0  # positions in `order`
        self.retired = 0
        self.exposed_s = 0.0
        self.dtype = dtype
        self.depth = min(DEPTH, len(self.order))
        self.slots: list[tuple[torch.Tensor, torch.Tensor]] = []  # allocated by the first round, freed after the last
        self.buffer_bytes = 0  # what the slots held (their real sizes): this exchange's own memory
        self.flight: deque[tuple[int, dist.Work | None, tuple[torch.Tensor, torch.Tensor]]] = deque()

    @property
    def done(self) -> bool:
        return self.retired == len(self.order)

    def _allocate(self) -> None:
        """The slots' buffers, each the largest of its kind in any round, reused by every round.

        Reused, not allocated per round: a finished collective's buffers may stay referenced by the
        backend's worker thread for a moment, and fresh ones per round would then pile up.
        """
        sizes = [max(sum(getattr(r, f"{self.kind}_{side}_splits")) for r in self.plan.rounds)
                 for side in ("send", "recv")]
        self.slots = [
            tuple(torch.empty(n, dtype=self.dtype, device=self.opt.device) for n in sizes)
            for _ in range(self.depth)
        ]
        self.buffer_bytes = sum(b.numel() * b.element_size() for slot in self.slots for b in slot)

    def _issue(self) -> None:
        if not self.slots:
            self._allocate()
        k = self.order[self.issued]
        rnd = self.plan.rounds[k]
        send_buffer, recv_buffer = self.slots[self.issued % self.depth]
        send = send_buffer[: sum(getattr(rnd, f"{self.kind}_send_splits"))]
        recv = recv_buffer[: sum(getattr(rnd, f"{self.kind}_recv_splits"))]
        self.pack(rnd, send)
        work = None
        if self.opt.layout.world_size == 1:
            recv.copy_(send)
        else:
            work = dist.all_to_all_single(
                recv, send, list(getattr(rnd, f"{self.kind}_recv_splits")),
                list(getattr(rnd, f"{self.kind}_send_splits")), group=self.opt.group, async_op=True,
            )
        self.flight.append((k, work, (send, recv)))
        self.issued += 1

    def _retire(self) -> None:
        k, work, views = self.flight.popleft()
        if work is not None:
            work.wait()
        self.unpack(self.plan.rounds[k], views[1])
        self.retired += 1
        del work, views  # this round's references to the slots' storage, which the wait below counts
        if self.done:  # the exchange is over: its buffers go before the next allocation needs the memory,
            wait_alone(b for slot in self.slots for b in slot)  # and on this thread (collectives.py)
            self.slots = []

    def _finished(self) -> bool:
        """Whether the oldest round in flight has completed (never waits)."""
        work = self.flight[0][1]
        return work is None or work.is_completed()

    def _issue_until(self, stop: int) -> int:
        """Issue rounds up to position `stop` of the order, retiring the oldest whenever every slot is in
        flight (that waits for it); returns how many were issued."""
        count = 0
        while self.issued < stop:
            if len(self.flight) == self.depth:
                self._retire()
            self._issue()
            count += 1
        return count

    @contextlib.contextmanager
    def _exposed(self) -> Iterator[None]:
        """The training thread inside the exchange: its time is exposed, its allocations the meter's exchange's."""
        start = time.perf_counter()
        with torch.no_grad(), record_function(EXCHANGE_WINDOW):
            yield
        self.exposed_s += time.perf_counter() - start

    def finish(self) -> None:
        """Every remaining round, waited for; the buffers are freed."""
        with self._exposed():
            self._issue_until(len(self.order))
            while self.flight:
                self._retire()

    @abstractmethod
    def pack(self, rnd: ExchangeRound, send: torch.Tensor) -> None:
        """Copy what this rank sends in `rnd` into `send`."""

    @abstractmethod
    def unpack(self, rnd: ExchangeRound, recv: torch.Tensor) -> None:
        """Use what this rank received in `rnd`."""


class GatherStream(_Rounds):
    """The compute shard filled from the owners' masters, in model order, one round ahead of compute."""

    def __init__(self, opt: ShardedOptimizer, plan: ExchangePlan, params: Sequence[torch.Tensor],
                 dtype: torch.dtype) -> None:
        if len(params) != len(plan.local):
            raise HydraulisError(f"gather: {len(params)} parameters, the exchange plan has {len(plan.local)}")
        super().__init__(opt, plan, "gather", dtype, range(len(plan.rounds)))
        self.params = params
        self.index = {p.name: i for i, p in enumerate(plan.local)}
        self.early = 0  # rounds issued from the layers' hooks, ahead of compute

    def pack(self, rnd: ExchangeRound, send: torch.Tensor) -> None:
        pos = 0
        for off, n in rnd.gather_send:
            send[pos : pos + n].copy_(self.opt.master[off : off + n])
            pos += n

    def unpack(self, rnd: ExchangeRound, recv: torch.Tensor) -> None:
        pos = 0
        for i, off, n in rnd.gather_recv:
            for piece in self.plan.local[i].pieces(self.params[i], off, off + n):
                piece.copy_(recv[pos : pos + piece.numel()].view(piece.shape))
                pos += piece.numel()

    def need(self, names: Sequence[str]) -> None:
        """Parameters `names` whole before they are used; the round after them already in flight."""
        if self.done:
            return
        last = max((self.plan.gather_needs[self.index[n]] for n in names if n in self.index), default=-1)
        if last < self.retired:
            return
        with self._exposed():
            self.early += self._issue_until(min(last + 2, len(self.order)))  # through round last + 1: the prefetch
            while self.retired <= last:
                self._retire()


class ReduceStream(_Rounds):
    """Gradients summed into the owners' `grad`, in reverse model order, each round sent once it is final."""

    def __init__(self, opt: ShardedOptimizer, plan: ExchangePlan, grads: Callable[[int], Gradient],
                 dtype: torch.dtype, after: GatherStream | None = None, accumulate: bool = False,
                 reduce_after: int = 1) -> None:
        super().__init__(opt, plan, "reduce", dtype, range(len(plan.rounds) - 1, -1, -1))
        self.grads = grads  # local parameter index -> its accumulated gradient (None: zero) and factor (main_grad.py)
        # The gather of the same iteration: its rounds use the same group, so all of them go out before this
        # reduce's first (every rank issues the collectives in one order), and its buffers are freed by then.
        self.after = after
        self.sealed: set[int] = set()
        self.counts: dict[int, int] = {}
        self.early = 0  # rounds issued from backward's hooks, while it went on
        self.index = {p.name: i for i, p in enumerate(plan.local)}
        self.tail = _tail(self.index, reduce_after)
        if not accumulate:  # a later phase of an iteration adds to what the earlier phases reduced
            opt.grad.zero()

    def _start(self) -> None:
        """Before the first round: the gather's last rounds, which must precede it on the group, and the owned
        sum's storage (outside the exchange's window: it is the optimizer's state, not the exchange's buffers)."""
        if self.after is not None:
            gather, self.after = self.after, None
            gather.finish()
        self.opt.grad.allocate()

    def finish(self) -> None:
        self._start()
        super().finish()

    def pack(self, rnd: ExchangeRound, send: torch.Tensor) -> None:
        pos = 0
        for i, off, n in rnd.reduce_send:
            g, unscale = self.grads(i)
            if g is None:
                send[pos : pos + n].zero_()
                pos += n
                continue
            start = pos
            for piece in self.plan.local[i].pieces(g, off, off + n):
                send[pos : pos + piece.numel()].view(piece.shape).copy_(piece)
                pos += piece.numel()
            if unscale is not None:  # a scaled fp16 sum: its value in the send dtype (exact, a power of two)
                send[start:pos].mul_(unscale)

    def unpack(self, rnd: ExchangeRound, recv: torch.Tensor) -> None:
        self.opt.grad.add(rnd.reduce_recv, recv)

    def accumulated(self, name: str, expected: int) -> None:
        """A gradient of `name` was accumulated; after its `expected`-th, send what became final (never waits)."""
        i = self.index.get(name)
        if i is None:
            return
        if i in self.sealed:
            raise HydraulisError(f"{name}: a gradient accumulated after its reduce was sent (expected {expected})")
        self.counts[i] = self.counts.get(i, 0) + 1
        if self.counts[i] < expected:
            return
        self.sealed.add(i)
        if self.issued == 0 and i in self.tail:
            return  # the buffers wait until the stage's last blocks are through backward and their activations freed
        if self.issued == 0 and self.plan.reduce_reads[self.order[0]] <= self.sealed:
            self._start()
        with self._exposed():
            while self.flight and self._finished():
                self._retire()
            while (self.after is None and self.issued < len(self.order) and len(self.flight) < self.depth
                   and self.plan.reduce_reads[self.order[self.issued]] <= self.sealed):
                self._issue()
                self.early += 1


def _tail(index: dict[str, int], blocks: int = 1) -> set[int]:
    """The parameters backward reaches first: the head, the final norm and the stage's last `blocks` blocks."""
    layers = sorted({int(name.split(".")[1]) for name in index if name.startswith("layers.")})
    last = tuple(f"layers.{k}." for k in layers[-blocks:]) if layers else ()
    return {i for name, i in index.items() if name.startswith(("norm.", "output.", *last))}


class Exchange:
    """One iteration's gather and reduce on one rank, driven by the model's hooks while it computes
    (`ExchangeHooks.exchanging`)."""

    def __init__(self, opt: ShardedOptimizer, plan: ExchangePlan, params: Sequence[torch.nn.Parameter],
                 dtype: torch.dtype, reduce_dtype: torch.dtype, micro_batches: int, enabled: bool = True,
                 accumulate: bool = False, reduce_after: int = 1) -> None:
        self.gather = GatherStream(opt, plan, params, dtype)
        self.reduce = ReduceStream(opt, plan, lambda i: gradient(params[i]), reduce_dtype, after=self.gather,
                                   accumulate=accumulate, reduce_after=reduce_after)
        self.micro_batches = micro_batches
        self.enabled = enabled  # False: the hooks do nothing, gather and reduce run whole (`gather_ahead`, `finish`)

    def gather_ahead(self) -> None:
        self.gather.finish()

    def finish(self) -> None:
        self.gather.finish()
        self.reduce.finish()

    @property
    def exposed_s(self) -> float:
        return self.gather.exposed_s + self.reduce.exposed_s

    @property
    def buffer_bytes(self) -> int:
        """The most bytes this exchange's buffers held at once (the reduce allocates after the gather freed)."""
        return max(self.gather.buffer_bytes, self.reduce.buffer_bytes)


def gather(opt: ShardedOptimizer, plan: ExchangePlan, params: Sequence[torch.Tensor],
           dtype: torch.dtype) -> None:
    """Fill `params` (a compute shard, in plan.local order) from the owners, every round at once."""
    GatherStream(opt, plan, params, dtype).finish()


def reduce(opt: ShardedOptimizer, plan: ExchangePlan, grads: Sequence[torch.Tensor | None],
           dtype: torch.dtype = torch.float32, unscale: Sequence[torch.Tensor | None] | None = None) -> None:
    """Sum every rank's gradients into the owners' `opt.grad`, every round at once (None counts as zero).

    `grads` are the compute shard's gradients in plan.local order, each times its `unscale` factor where
    one is given (scaled fp16 sums, main_grad.py); they travel in `dtype` and are summed in fp32.
    """
    ReduceStream(opt, plan, lambda i: (grads[i], None if unscale is None else unscale[i]), dtype).finish()


class ExchangeHooks:
    """A stage model's hooks and the exchange they drive: none outside `exchanging`, so they do nothing."""

    def __init__(self) -> None:
        self.current: Exchange | None = None

    @contextlib.contextmanager
    def exchanging(self, ex: Exchange) -> Iterator[Exchange]:
        """The hooks gather ahead of each layer and reduce behind backward into `ex`, until the block ends."""
        self.current = ex
        try:
            yield ex
        finally:
            self.current = None


def attach_exchange_hooks(model: torch.nn.Module) -> ExchangeHooks:
    """Hooks that drive an `Exchange` while `ExchangeHooks.exchanging` holds one, registered once per stage model.

    Register after `attach_main_grads`: hooks run in order, so the main gradient is complete when it is sent.
    """
    hooks = ExchangeHooks()
    names = {id(p): n for n, p in model.named_parameters()}
    groups: list[tuple[torch.nn.Module, list[str]]] = []
    if getattr(model, "embedding", None) is not None:
        groups.append((model.embedding, [names[id(p)] for p in model.embedding.parameters()]))
    for layer in model.layers.values():
        groups.append((layer, [names[id(p)] for p in layer.parameters()]))
    if getattr(model, "norm", None) is not None:  # the head runs right after the norm, as a weight, not a module
        head = [n for n in names.values() if n.startswith(("norm.", "output.", "embedding."))]
        groups.append((model.norm, head))
    for k, (module, wanted) in enumerate(groups):
        module.register_forward_pre_hook(_needs(hooks, tuple(wanted), last=k == len(groups) - 1))
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(_sealer(hooks, name))
    return hooks


def _needs(hooks: ExchangeHooks, names: tuple[str, ...], last: bool) -> Callable:
    """The gather rounds a module needs; the last module's hook finishes the gather.

    Waiting is safe here: the rank's TP and CP peers reach the same hook with no collective in between,
    and ask for the same rounds (`ExchangePlan.gather_needs` covers the stage). The rounds no layer asks
    for go out at the same point on every peer, so none of them waits inside a later layer's collective.
    """
    def hook(module: torch.nn.Module, args: tuple) -> None:
        ex = hooks.current
        if ex is not None and ex.enabled:
            ex.gather.need(names)
            if last:
                ex.gather.finish()

    return hook


def _sealer(hooks: ExchangeHooks, name: str) -> Callable:
    def hook(p: torch.Tensor) -> None:
        ex = hooks.current
        if ex is not None and ex.enabled:
            ex.reduce.accumulated(name, ex.micro_batches)

    return hook
