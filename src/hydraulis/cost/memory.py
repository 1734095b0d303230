"""Memory: the training state the runtime holds, and the per-GPU cap it leaves for activations.

`TrainingState` is the one definition of bytes per parameter that the
analytic memory model and the runtime's prediction of its peak both read;
`MemoryModel.cap` is the most tokens a micro-batch of a config may hold
(docs/design.md, section 4), under CP with the K/V buffers attention keeps,
and zero where the optimizer exchange's buffers do not fit. `rank_memory`
is one rank's peak buffer by buffer, which the trainer logs beside the
peak torch's allocator measures (runtime/step_memory.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hydraulis.context import max_rank_tokens
from hydraulis.parallel import ParallelConfig
from hydraulis.specs import ModelSpec

CAP_GRANULARITY = 128
DEFAULT_EXCHANGE_BUCKET_BYTES = 256 << 20  # [parallel] exchange_bucket_mb's default
RECOMPUTE_INPUT_BYTES = 2  # a layer's input kept under full recompute (bf16)
KV_BYTES = 2  # K and V travel over the CP group in the compute dtype (bf16)
LIVE_KV_COPIES = 3  # document-sized K/V copies of the one layer in CP backward (kv_buffer_bytes)


def kv_shard_dim(model: ModelSpec, tp: int) -> int:
    """K (or V) columns one TP rank holds: its share of the KV heads, one whole head when tp > kv_heads."""
    return model.kv_heads * model.head_dim // min(tp, model.kv_heads)


def kv_buffer_bytes(model: ModelSpec, config: ParallelConfig, recompute: bool = False) -> float:
    """Bytes per token of a micro-batch that CP adds on a rank, beyond its share of the activations.

    Attention is blockwise (runtime/blockwise_attention.py): a chunk at [a, b) keeps for backward
    its own K/V (counted in the activations) and a copy of the gathered prefix 0..a-1. A rank's two
    zigzag chunks k and 2cp-1-k start at k/2cp and (2cp-1-k)/2cp of the document, so it keeps
    (1 - 1 / 2cp) x the document's K/V per layer, for every layer in flight (L under 1F1B, one under
    full recompute). On top, while one layer runs backward: its gathered K/V's gradient, the
    gathered layout of it, and the reduce-scatter's reordered copy (3 x the document's K/V). Nothing
    is O(chunk x prefix): no mask, and the block kernels keep O(chunk) softmax statistics.
    """
    if config.cp == 1:
        return 0.0
    per_layer = 2 * kv_shard_dim(model, config.tp) * KV_BYTES
    kept_layers = 1 if recompute else model.layers
    return kept_layers * per_layer * (1 - 1 / (2 * config.cp)) + LIVE_KV_COPIES * per_layer


@dataclass(frozen=True)
class TrainingState:
    """Bytes per parameter of training state, exactly as the runtime holds it (runtime/optimizer.py).

    With the compute shard (replicated across replicas): parameters and
    gradients in the compute dtype. Sharded over all N ranks (the fixed
    optimizer layout): fp32 master weights, two fp32 AdamW moments and the
    fp32 reduced gradient. The analytic memory model and `rank_memory` both
    read this one definition.
    """

    param_bytes: int = 2
    grad_bytes: int = 2
    master_bytes: int = 4
    moment_bytes: int = 8
    reduced_grad_bytes: int = 4

    @property
    def replicated_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes

    @property
    def sharded_bytes(self) -> int:
        return self.master_bytes + self.moment_bytes + self.reduced_grad_bytes

    @property
    def total_bytes(self) -> int:
        return self.replicated_bytes + self.sharded_bytes

    @property
    def sharded_fraction(self) -> float:
        """The memory model's optimizer_sharded_fraction (alpha)."""
        return self.sharded_bytes / self.total_bytes


@dataclass(frozen=True)
class MemoryModel:
    """Per-GPU memory of a config when optimizer states are sharded over all N GPUs."""

    memory_bytes: int
    activation_bytes_per_token_hidden_layer: dict[int, float]
    state_bytes_per_hidden2_layer: float
    optimizer_sharded_fraction: float
    context_overhead_bytes: float
    safety_margin_bytes: float
    embedding_state_bytes: float = 16.0  # training-state bytes per embedding or head parameter (design section 4)
    # The optimizer exchange's buffers (runtime/exchange.py): two rounds in flight, each a send and a receive
    # buffer of half a bucket, two buckets of the default 256 MiB in all. Overlapped with compute
    # (runtime/overlap.py), they live beside the activations: the gather's in the first micro-batch's
    # forward, the reduce's in the last one's backward.
    exchange_bytes: float = 2 * DEFAULT_EXCHANGE_BUCKET_BYTES

    def exchange_buffer_bytes(self, model: ModelSpec) -> float:
        """The exchange's two buffers: each at most a bucket, and at most the model in fp32."""
        return min(self.exchange_bytes, 2 * 4 * model.num_params)

    def activation_factor(self, tp: int) -> float:
        table = self.activation_bytes_per_token_hidden_layer
        if tp in table:
            return table[tp]
        # Between measured TP degrees, interpolate in log2(tp); outside, hold the edge.
        keys = np.array(sorted(table), dtype=float)
        values = np.array([table[int(k)] for k in keys])
        return float(np.interp(np.log2(tp), np.log2(keys), values))

    def static_bytes(self, config: ParallelConfig, model: ModelSpec, num_gpus: int) -> float:
        L, H, V = model.layers, model.hidden, model.vocab
        B, alpha = self.state_bytes_per_hidden2_layer, self.optimizer_sharded_fraction
        tp, pp = config.tp, config.pp
        per_matrix = self.embedding_state_bytes
        e = 2 * per_matrix if pp == 1 else per_matrix  # embedding and head on one GPU when pp = 1
        return (
            (L / pp) * (H * H / tp) * B * (1 - alpha)
            + L * H * H * B * alpha / num_gpus
            + (H * V / tp) * e * (1 - alpha)
            + H * V * 2 * per_matrix * alpha / num_gpus
        )

    def bytes_per_token(self, config: ParallelConfig, model: ModelSpec, recompute: bool = False) -> float:
        """Activation bytes per token one rank holds (under CP, per token of the rank's share)."""
        # 1F1B keeps pp micro-batches in flight on the first stage, L/pp layers each: L in all.
        full = (model.hidden / config.tp) * self.activation_factor(config.tp)
        if recompute:
            # Only each layer's input is kept (compute dtype, full hidden), plus the one layer whose
            # activations are being recomputed in backward.
            return model.layers * model.hidden * RECOMPUTE_INPUT_BYTES + full
        return model.layers * full

    def free_bytes(self, config: ParallelConfig, model: ModelSpec, num_gpus: int) -> float:
        """What a GPU has left for activations after the margin, the context, the static state and the
        exchange's buffers (beside the activations, as the exchange overlaps compute)."""
        return (
            self.memory_bytes
            - self.safety_margin_bytes
            - self.context_overhead_bytes
            - self.static_bytes(config, model, num_gpus)
            - self.exchange_buffer_bytes(model)
        )

    def activation_bytes(
        self, config: ParallelConfig, model: ModelSpec, tokens: int, recompute: bool = False
    ) -> float:
        """Activation bytes on the fullest rank for a micro-batch of `tokens` (CP: its share plus K/V buffers)."""
        held = max_rank_tokens(tokens, config.cp)
        per_token = self.bytes_per_token(config, model, recompute)
        return float(held) * per_token + tokens * kv_buffer_bytes(model, config, recompute)

    def cap(self, config: ParallelConfig, model: ModelSpec, num_gpus: int, recompute: bool = False) -> int:
        """Most tokens (a multiple of 128) whose activation_bytes fit in free_bytes.

        Under CP a rank holds at most ceil(T/cp) + 2*cp tokens of a micro-batch of T, so the cap is about
        cp * (per-rank cap - 2*cp), less the K/V that attention keeps (`kv_buffer_bytes`).
        """
        free = self.free_bytes(config, model, num_gpus)
        if free <= 0:
            return 0  # not even the exchange's buffers fit beside the training state
        per_token = self.bytes_per_token(config, model, recompute)
        cp = config.cp
        if cp == 1:
            tokens = int(free / per_token)
        else:
            # T/cp + 2cp + T*buffer/per_token <= free/per_token, then down past the ceiling's rounding.
            share = 1 / cp + kv_buffer_bytes(model, config, recompute) / per_token
            tokens = max(0, int((free / per_token - 2 * cp) / share))
            while tokens > 0 and self.activation_bytes(config, model, tokens, recompute) > free:
                tokens -= 1
        return tokens // CAP_GRANULARITY * CAP_GRANULARITY


LOGIT_COPIES = 2  # the head's fp32 logits and their gradient, both live in the loss's backward
LOGIT_BYTES = 4
MAIN_GRAD_BYTES = 4  # fp32 main gradients under bf16 compute (runtime/main_grad.py)
ACTIVATION_DTYPE_BYTES = 2  # the activation factors above are for bf16


def shard_params(model: ModelSpec, config: ParallelConfig, stage: int) -> int:
    """Compute-shard elements one rank holds: its stage's layers split over TP (norms replicated), plus the
    embedding on the first stage and the final norm and head on the last (KV heads counted as split)."""
    h, v = model.hidden, model.vocab
    per_layer = (model.params_per_layer - 2 * h) // config.tp + 2 * h
    n = model.layers // config.pp * per_layer
    if stage == 0:
        n += v * h // config.tp
    if stage == config.pp - 1:
        n += v * h // config.tp + h
    return n


@dataclass(frozen=True)
class RankMemory:
    """The bytes one rank holds at its peak, buffer by buffer (the runtime's, runtime/trainer.py).

    The compute shard's parameters and the owned fp32 master, moments and reduced gradient are held
    throughout. The gradients (fp32 main gradients under bf16) are freed after every step, so backward
    allocates them afresh: with one micro-batch on one stage the activations are mostly freed by the
    time they are, and only the head's gradient meets the logits; with more micro-batches (or 1F1B
    stages) the next forward's activations meet all of them. The exchange overlaps compute, so its
    buffers count beside the activations (the gather's in the first forward, the reduce's in the last
    backward) and after the backward (the reduce's tail), as does the AdamW step's bucket-sized temporary.
    """

    params: float
    grads: float
    owned: float
    activations: float
    grads_with_activations: float
    exchange: float
    step: float

    @property
    def peak(self) -> float:
        # Overlapped with compute, the exchange's buffers meet the activations (runtime/overlap.py).
        during = self.activations + self.grads_with_activations + self.exchange
        after = self.grads + max(self.exchange, self.step)
        return self.params + self.owned + max(during, after)


def rank_memory(
    memory: MemoryModel,
    model: ModelSpec,
    config: ParallelConfig,
    stage: int,
    num_gpus: int,
    tokens: int,
    dtype_bytes: int,
    bucket_bytes: int,
    recompute: bool = False,
    micro_batches: int = 2,
) -> RankMemory:
    """A rank's memory for `micro_batches` micro-batches of at most `tokens` in the compute dtype's bytes."""
    shard = shard_params(model, config, stage)
    grad_bytes = MAIN_GRAD_BYTES if dtype_bytes < MAIN_GRAD_BYTES else dtype_bytes
    last = stage == config.pp - 1
    if micro_batches > 1 or config.pp > 1:
        grads_with_activations = shard * grad_bytes
    else:
        grads_with_activations = model.vocab * model.hidden / config.tp * grad_bytes if last else 0.0
    owned = -(-model.num_params // num_gpus)
    activations = memory.activation_bytes(config, model, tokens, recompute) * dtype_bytes / ACTIVATION_DTYPE_BYTES
    if last:
        activations += LOGIT_COPIES * LOGIT_BYTES * max_rank_tokens(tokens, config.cp) * model.vocab / config.tp
    return RankMemory(
        params=shard * dtype_bytes,
        grads=shard * grad_bytes,
        owned=owned * TrainingState().sharded_bytes,
        activations=activations,
        grads_with_activations=grads_with_activations,
        # A buffer holds at most one bucket and at most what the rank moves: its shard, or the owned range
        # once per replica (a homogeneous pool's count of this config's replicas).
        exchange=2 * min(bucket_bytes, 4 * max(shard, owned * max(1, num_gpus // config.num_gpus))),
        step=min(bucket_bytes, owned * 4),
    )
