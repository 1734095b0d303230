"""The plain-PyTorch peers of `benchmarks/peers.py`: transformers' LlamaForCausalLM under DDP or FSDP2.

A separate module so that peers.py stays short and tests can import the peers' step bodies
(tests/test_benchmark_peers.py checks them against Hydraulis's single-process `StageModel`).

The peers train the objective Hydraulis trains, so that tokens/s compare like with like:

- the same model and initial weights: `hf_config(spec)` and `to_hf_state_dict` of the values
  Hydraulis's optimizer owners start from (`ShardLayout(spec, 1).full_state_dict(seed)`);
- the same loss: the sum of token cross-entropies of every document of the global batch, divided
  by the batch's real targets (`count_targets`); targets never cross a document and positions
  restart at each document (`concatenate_documents` builds both, as for Hydraulis);
- the same AdamW (decay on matrices only), learning-rate schedule and global-norm clipping.

Documents are split over the ranks by tokens, greedily: each document, in batch order, goes to the
rank with the fewest tokens so far (the lowest rank on ties). DDP and FSDP2 AVERAGE gradients over
ranks, so each rank's loss is multiplied by the world size: the average is then the gradient of the
global objective. A rank without documents still runs one forward and backward of one token with
zero loss, because DDP's all-reduce and FSDP2's collectives need every rank.

Exposed exchange time: the seconds of a step in which a rank's training thread waits for a collective
of parameters or gradients to complete, instead of computing (`BackwardTail` for DDP, `TimedCollectives`
for FSDP2; Hydraulis's trainer reports its own). It includes waiting for the slowest rank, since a
collective completes only once every rank has joined it. Not counted for any variant: the one-scalar
all-reduce of the global grad norm, and DDP's per-step broadcast of module buffers (rotary frequencies).
A differential twin (the step's time minus the same step without communication) was rejected: on 4
processes sharing 2 cores two timings of the same work differ by more than the exchange takes.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from hydraulis.optim import OptimSettings
from hydraulis.runtime.optimizer.layout import ShardLayout
from hydraulis.runtime.parallelism.batch import IGNORE_INDEX, concatenate_documents
from hydraulis.runtime.storage.hf import hf_config, to_hf_state_dict
from hydraulis.specs import ModelSpec

PEERS = ("ddp-doc", "ddp-packed", "fsdp2")
# What a user of a homogeneous system does when a long document does not fit: recompute activations.
CHECKPOINTED = ("ddp-doc-gc", "fsdp2-ac")
# FSDP2's default collectives, by their newer names where this torch has them (older: *_into_tensor, *_tensor)
_dist = torch.distributed
all_gather_single = getattr(_dist, "all_gather_single", None) or _dist.all_gather_into_tensor
reduce_scatter_single = getattr(_dist, "reduce_scatter_single", None) or _dist.reduce_scatter_tensor
Accumulate = Callable[[bool], AbstractContextManager]  # is it the last document? -> the context it runs in


def split_by_tokens(lengths: Sequence[int], world: int) -> list[list[int]]:
    """Document indices per rank: each document, in batch order, to the rank with the fewest tokens so far."""
    load = [0] * world
    out: list[list[int]] = [[] for _ in range(world)]
    for i, s in enumerate(lengths):
        r = min(range(world), key=lambda k: (load[k], k))
        out[r].append(i)
        load[r] += int(s)
    return out


def rank_documents(batch, corpus: Sequence[np.ndarray], indices: Sequence[int]) -> list[torch.Tensor]:
    """The batch's documents `indices` as int64 tensors, read from the memory-mapped corpus (only these)."""
    docs = []
    for i in indices:
        start, n = int(batch.starts[i]), int(batch.lengths[i])
        docs.append(torch.from_numpy(np.asarray(corpus[int(batch.docs[i])][start : start + n], dtype=np.int64)))
    return docs


def hf_model(spec: ModelSpec, seed: int, attention: str = "sdpa") -> nn.Module:
    """transformers' LlamaForCausalLM (fp32) holding exactly the initial weights Hydraulis starts from."""
    from transformers import LlamaForCausalLM

    config = hf_config(spec)
    config._attn_implementation = attention  # sdpa: 4-D inputs, so CPU takes the fused flash kernel
    model = LlamaForCausalLM(config).float()
    model.load_state_dict(to_hf_state_dict(ShardLayout(spec, 1).full_state_dict(seed), spec), strict=True)
    return model.train()


def checkpoint_layers(model: nn.Module) -> nn.Module:
    """transformers' activation checkpointing of every decoder layer, non-reentrant (its newer name where it
    has it): each layer's forward runs again in backward, only its input is kept."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def block_causal_mask(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """(1, 1, T, T) bool, True where query t may attend key u: same document and u <= t."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    doc = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    same = doc[:, None] == doc[None, :]
    return (same & torch.ones_like(same).tril())[None, None]


def _token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float(), targets, ignore_index=IGNORE_INDEX, reduction="sum")


def _idle_backward(model: nn.Module) -> None:
    """One token with zero loss: this rank joins the gradient collectives without contributing."""
    model(input_ids=torch.zeros((1, 1), dtype=torch.int64), use_cache=False).logits.sum().mul(0.0).backward()


def document_backward(
    model: nn.Module, docs: Sequence[torch.Tensor], total_targets: int, scale: float = 1.0,
    accumulate: Accumulate = lambda last: nullcontext(),
) -> torch.Tensor:
    """One forward and backward per document (batch of one, no padding), gradients accumulated.

    Returns the detached sum of token losses; the backward runs on that sum * scale / total_targets.
    `accumulate(last)` is the context of each document (DDP: no_sync for all but the last).
    """
    loss_sum = torch.zeros(())
    if not docs:
        with accumulate(True):
            _idle_backward(model)
        return loss_sum
    for i, doc in enumerate(docs):
        packed = concatenate_documents([doc])
        with accumulate(i == len(docs) - 1):
            logits = model(input_ids=packed.tokens[None], use_cache=False).logits[0]
            loss = _token_loss(logits, packed.targets)
            (loss * (scale / total_targets)).backward()
        loss_sum += loss.detach()
    return loss_sum


def packed_backward(
    model: nn.Module, docs: Sequence[torch.Tensor], total_targets: int, scale: float = 1.0
) -> torch.Tensor:
    """All documents in one row: positions restart per document, a 4-D block-diagonal causal mask.

    Exact (attention never crosses a document), but attention is dense over the row: SDPA computes
    T x T scores and masks them, where Hydraulis runs SDPA per document.
    """
    if not docs:
        _idle_backward(model)
        return torch.zeros(())
    packed = concatenate_documents(docs)
    logits = model(
        input_ids=packed.tokens[None],
        position_ids=packed.positions[None],
        attention_mask=block_causal_mask(packed.cu_seqlens),
        use_cache=False,
    ).logits[0]
    loss = _token_loss(logits, packed.targets)
    (loss * (scale / total_targets)).backward()
    return loss.detach()


def adamw(model: nn.Module, optim: OptimSettings) -> torch.optim.AdamW:
    """torch's AdamW with Hydraulis's settings: weight decay on matrices (embedding included), not on norms."""
    a = optim.adamw
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": a.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=optim.lr, betas=a.betas, eps=a.eps, foreach=True)


class BackwardTail:
    """DDP's exposed exchange: from the last gradient a backward produced to that backward's return.

    DDP's reducer all-reduces each bucket asynchronously (gloo's worker threads, CUDA's comm stream)
    as soon as its gradients are ready, overlapping the rest of the backward, and waits for all of
    them when the backward ends. After the last gradient there is no compute left to hide anything:
    the tail is the last bucket's all-reduce, the wait for buckets still in flight (and for the
    slowest rank) and the copy back into `.grad`. A post-accumulate-grad hook on every parameter
    stamps the last gradient. Under `no_sync` the tail is the autograd engine's return alone.
    """

    def __init__(self, module: nn.Module) -> None:
        self.last: float | None = None
        for p in module.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._stamp)

    def _stamp(self, param: torch.Tensor) -> None:
        self.last = time.perf_counter()

    def take(self) -> float:
        """Call right after the step's last backward returns: its tail in seconds (and reset)."""
        returned, last = time.perf_counter(), self.last
        if last is None:
            raise RuntimeError("no gradient was produced since the last take(): was backward run?")
        self.last = None
        return returned - last


class TimedCollectives:
    """FSDP2's exposed exchange: the seconds spent in its all-gathers and reduce-scatters.

    FSDP2 overlaps its collectives with compute through CUDA streams; on CPU its streams do nothing
    and it calls every collective with async_op=False (no explicit prefetching is set), so the
    thread is blocked for each one's whole duration: all of it is exposed. Installed on every FSDP
    module with FSDP2's `set_custom_all_gather`/`set_custom_reduce_scatter` (torch >= 2.9), calling
    the collectives FSDP2 calls by default. With async_op=True the call is only a launch, and the
    wait would go uncounted: this measure is the gloo benchmark's, not a CUDA one.
    """

    def __init__(self) -> None:
        self.spent = 0.0
        self.calls = {"all_gather": 0, "reduce_scatter": 0}

    def install(self, model: nn.Module) -> TimedCollectives:
        from torch.distributed.fsdp import FSDPModule

        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_custom_all_gather(_TimedComm(self, "all_gather"))
                m.set_custom_reduce_scatter(_TimedComm(self, "reduce_scatter"))
        return self

    def take(self) -> float:
        """The seconds spent in collectives since the last take (and reset)."""
        spent, self.spent = self.spent, 0.0
        return spent


class _TimedComm:
    """FSDP2's comm interface (`allocate`, and a call with its keywords): its default collective, timed."""

    def __init__(self, clock: TimedCollectives, kind: str) -> None:
        self.clock, self.kind = clock, kind

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group, op=None, async_op: bool = False):
        start = time.perf_counter()
        if self.kind == "all_gather":
            work = all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)
        else:
            work = reduce_scatter_single(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
        self.clock.spent += time.perf_counter() - start
        self.clock.calls[self.kind] += 1
        return work


@dataclass
class Peer:
    """One peer on one rank: a wrapped model, its optimizer and how it runs a global batch."""

    name: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    optim: OptimSettings
    total_steps: int
    world: int
    packed: bool
    accumulate: Accumulate
    exchange: BackwardTail | TimedCollectives

    def step(
        self, docs: Sequence[torch.Tensor], total_targets: int, step: int
    ) -> tuple[torch.Tensor, torch.Tensor, float]:
        """Forward, backward, clip and AdamW on this rank's documents.

        Returns (local loss sum, global grad norm, exposed exchange seconds of this rank).
        """
        if self.packed:
            loss_sum = packed_backward(self.model, docs, total_targets, self.world)
        else:
            loss_sum = document_backward(self.model, docs, total_targets, self.world, self.accumulate)
        exposed = self.exchange.take()  # the synchronising backward was the last thing either ran
        clip = self.optim.adamw.grad_clip
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip if clip > 0 else math.inf)
        for group in self.optimizer.param_groups:
            group["lr"] = self.optim.lr_at(step, self.total_steps)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss_sum, norm, exposed


def build_peer(name: str, spec: ModelSpec, seed: int, optim: OptimSettings, total_steps: int, world: int) -> Peer:
    """ddp-doc, ddp-packed (torch DDP, default buckets) or fsdp2 (fully_shard per decoder layer and the root);
    ddp-doc-gc and fsdp2-ac: the same with activation checkpointing of every decoder layer.

    FSDP2 keeps parameters unsharded from a step's first forward to its last backward
    (reshard_after_forward=False, no resharding or reduce-scatter until the last document): one
    all-gather and one reduce-scatter per step, FSDP2's recommended set-up for gradient
    accumulation, and it lets ranks run different numbers of documents. Checkpointing is transformers'
    own (`checkpoint_layers`), non-reentrant (torch's recommendation, and what DDP's hooks and FSDP2's
    need), applied before wrapping as torchtitan applies its activation checkpointing.
    """
    import torch.distributed as dist

    model = hf_model(spec, seed)
    if name in CHECKPOINTED:
        checkpoint_layers(model)
        name = name.rsplit("-", 1)[0]
    if name in ("ddp-doc", "ddp-packed"):
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(model)
        accumulate: Accumulate = lambda last: nullcontext() if last else ddp.no_sync()  # noqa: E731
        return Peer(name, ddp, adamw(ddp, optim), optim, total_steps, world, name == "ddp-packed", accumulate,
                    BackwardTail(model))
    if name != "fsdp2":
        raise ValueError(f"unknown peer {name!r}; one of {', '.join(PEERS)}")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, reshard_after_forward=False)

    @contextlib.contextmanager
    def accumulate_fsdp(last: bool):
        model.set_requires_gradient_sync(last)
        model.set_reshard_after_backward(last)
        yield

    return Peer(name, model, adamw(model, optim), optim, total_steps, world, False, accumulate_fsdp,
                TimedCollectives().install(model))


def scalar(t: torch.Tensor | float) -> float:
    """A float from a tensor, a DTensor (FSDP2's grad norm) or a float."""
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    return float(t)


def status_bytes(field: str) -> int:
    """A /proc/self/status memory field (VmRSS, VmHWM) in bytes; 0 where the file does not exist."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
