"""Memory: the training state the runtime holds, and the per-GPU cap it leaves for activations.

`TrainingState` is the one definition of bytes per parameter that the
analytic memory model and the runtime's prediction of its peak both read;
`rank_memory` is one rank's peak buffer by buffer, which the trainer logs
beside the peak torch's allocator measures (runtime/step_memory.py);
`MemoryModel.cap`, the most tokens a micro-batch of a config may hold
(docs/design.md, section 4), is the largest micro-batch whose `rank_memory`
peak fits on the config's first and last stage: under CP with the K/V
buffers attention keeps, and zero where the state and the optimizer
exchange's buffers do not fit.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from hydraulis.context import max_rank_tokens
from hydraulis.parallel import ParallelConfig
from hydraulis.specs import ModelSpec

CAP_GRANULARITY = 128
DEFAULT_EXCHANGE_BUCKET_BYTES = 256 << 20  # [parallel] exchange_bucket_mb's default
RECOMPUTE_INPUT_BYTES = 2  # a layer's input kept under full recompute (bf16)
KV_BYTES = 2  # K and V travel over the CP group in the compute dtype (bf16)
LIVE_KV_COPIES = 3  # document-sized K/V copies of the one layer in CP backward (kv_buffer_bytes)
LOGIT_COPIES = 2  # the head's fp32 logits and their gradient, both live in the loss's backward
LOGIT_BYTES = 4
MAIN_GRAD_BYTES = 4  # fp32 main gradients under bf16 compute (runtime/main_grad.py)
ACTIVATION_DTYPE_BYTES = 2  # the activation factors are for bf16 unless a profile says otherwise
CAP_DTYPE_BYTES = 2  # the caps are for bf16 compute unless the job says otherwise
BUDGET_MARGIN = 0.1  # the largest share of a memory budget per rank kept as the safety margin


def in_flight(config: ParallelConfig, stage: int, micro_batches: int) -> int:
    """Micro-batches whose activations a stage holds at once under 1F1B: min(pp - stage, M).

    Stage s warms up with min(pp - s - 1, M) forwards and then alternates one forward with one
    backward (runtime/pipeline.py), so a lone micro-batch on a deep replica is held once, not pp times.
    """
    return max(1, min(config.pp - stage, micro_batches))


def gradient_bytes(dtype_bytes: int) -> int:
    """Bytes per gradient element the runtime holds: fp32 main gradients under a 2-byte compute dtype."""
    return max(dtype_bytes, MAIN_GRAD_BYTES)


def logit_bytes(model: ModelSpec, config: ParallelConfig, tokens: int) -> float:
    """The last stage's fp32 logits and their gradient on its fullest rank (padded vocab / tp columns each)."""
    return LOGIT_COPIES * LOGIT_BYTES * max_rank_tokens(tokens, config.cp) * model.vocab_rows / config.tp


def kv_shard_dim(model: ModelSpec, tp: int) -> int:
    """K (or V) columns one TP rank holds: its share of the KV heads, one whole head when tp > kv_heads."""
    return model.kv_heads * model.head_dim // min(tp, model.kv_heads)


def kv_buffer_bytes(
    model: ModelSpec, config: ParallelConfig, recompute: bool = False, held: int | None = None
) -> float:
    """Bytes per token of a micro-batch that CP adds on a rank, beyond its share of the activations.

    Attention is blockwise (runtime/blockwise_attention.py): a chunk at [a, b) keeps for backward
    its own K/V (counted in the activations) and a copy of the gathered prefix 0..a-1. A rank's two
    zigzag chunks k and 2cp-1-k start at k/2cp and (2cp-1-k)/2cp of the document, so it keeps
    (1 - 1 / 2cp) x the document's K/V per layer, for every layer in flight (`held` micro-batches of
    L/pp layers under 1F1B, pp of them by default; one layer under full recompute). On top, while one
    layer runs backward: its gathered K/V's gradient, the
    gathered layout of it, and the reduce-scatter's reordered copy (3 x the document's K/V). Nothing
    is O(chunk x prefix): no mask, and the block kernels keep O(chunk) softmax statistics.
    """
    if config.cp == 1:
        return 0.0
    per_layer = 2 * kv_shard_dim(model, config.tp) * KV_BYTES
    kept_layers = 1 if recompute else model.layers // config.pp * (config.pp if held is None else held)
    return kept_layers * per_layer * (1 - 1 / (2 * config.cp)) + LIVE_KV_COPIES * per_layer


@dataclass(frozen=True)
class TrainingState:
    """Bytes per parameter of training state, exactly as the runtime holds it (runtime/optimizer.py).

    With the compute shard (replicated across replicas): parameters in the
    compute dtype and their gradients (fp32 main gradients under bf16).
    Sharded over all N ranks (the fixed optimizer layout): fp32 master
    weights, two fp32 AdamW moments and the fp32 reduced gradient. The
    analytic memory model and `rank_memory` both read this one definition;
    the default is bf16 compute.
    """

    param_bytes: int = 2
    grad_bytes: int = MAIN_GRAD_BYTES
    master_bytes: int = 4
    moment_bytes: int = 8
    reduced_grad_bytes: int = 4

    @classmethod
    def for_dtype(cls, dtype_bytes: int) -> TrainingState:
        """The state under a compute dtype of `dtype_bytes` bytes."""
        return cls(param_bytes=dtype_bytes, grad_bytes=gradient_bytes(dtype_bytes))

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
    # Bytes per element the activation factors were measured in (a measured profile: its dtype), and the
    # compute dtype the caps are for (the job's own, `for_job`).
    activation_dtype_bytes: int = ACTIVATION_DTYPE_BYTES
    compute_dtype_bytes: int = CAP_DTYPE_BYTES

    def for_job(self, memory_bytes: int | None, dtype_bytes: int, bucket_bytes: int | None = None) -> MemoryModel:
        """This model for a job's compute dtype, exchange bucket and, when given, memory budget per rank.

        The budget (`[parallel] memory_per_rank`) is what a rank's tensors may hold at their peak: what
        torch's allocator counts and what `torch.cuda.set_per_process_memory_fraction` limits on CUDA.
        The runtime's context lies outside it (no context overhead); the safety margin keeps its share
        of the memory, at most BUDGET_MARGIN, for the prediction's error and the allocator's slack.
        """
        out = replace(self, compute_dtype_bytes=dtype_bytes)
        if bucket_bytes is not None:
            out = replace(out, exchange_bytes=2 * bucket_bytes)
        if memory_bytes is None:
            return out
        share = self.safety_margin_bytes / self.memory_bytes if self.memory_bytes > 0 else 0.0
        return replace(
            out,
            memory_bytes=int(memory_bytes),
            context_overhead_bytes=0.0,
            safety_margin_bytes=min(share, BUDGET_MARGIN) * memory_bytes,
        )

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
        L, H, V = model.layers, model.hidden, model.vocab_rows
        B, alpha = self.state_bytes_per_hidden2_layer, self.optimizer_sharded_fraction
        tp, pp = config.tp, config.pp
        per_matrix = self.embedding_state_bytes
        tables = 1 if model.arch.tied_embeddings else 2  # what the optimizer owns: a tied head is no table of its own
        held = 1 if pp > 1 or head_is_embedding(model, config) else 2  # embedding and head on one GPU
        return (
            (L / pp) * (H * H / tp) * B * (1 - alpha)
            + L * H * H * B * alpha / num_gpus
            + (H * V / tp) * held * per_matrix * (1 - alpha)
            + H * V * tables * per_matrix * alpha / num_gpus
        )

    def bytes_per_token(
        self, config: ParallelConfig, model: ModelSpec, recompute: bool = False, held: int | None = None
    ) -> float:
        """Activation bytes per token one rank holds (under CP, per token of the rank's share), with `held`
        micro-batches of L/pp layers in flight (default pp, the first stage's in 1F1B: L layers in all)."""
        layers = model.layers // config.pp * (config.pp if held is None else held)
        full = (model.hidden / config.tp) * self.activation_factor(config.tp)
        if recompute:
            # Only each layer's input is kept (compute dtype, full hidden), plus the one layer whose
            # activations are being recomputed in backward.
            return layers * model.hidden * RECOMPUTE_INPUT_BYTES + full
        return layers * full

    def activation_bytes(
        self, config: ParallelConfig, model: ModelSpec, tokens: int, recompute: bool = False, held: int | None = None
    ) -> float:
        """Activation bytes on the fullest rank for `held` micro-batches of `tokens` (CP: its share plus K/V)."""
        rank_tokens = max_rank_tokens(tokens, config.cp)
        per_token = self.bytes_per_token(config, model, recompute, held)
        return float(rank_tokens) * per_token + tokens * kv_buffer_bytes(model, config, recompute, held)

    def stage_activation_bytes(
        self,
        config: ParallelConfig,
        model: ModelSpec,
        stage: int,
        tokens: int,
        dtype_bytes: int,
        recompute: bool,
        micro_batches: int | None = None,
    ) -> float:
        """What micro-batches of `tokens` hold on a stage's fullest rank in the compute dtype: the layers'
        activations of those in flight (`in_flight`; all pp of them when the count is not given) and, on the
        last stage, the fp32 logits and their gradient of the one in its loss."""
        held = None if micro_batches is None else in_flight(config, stage, micro_batches)
        scale = dtype_bytes / self.activation_dtype_bytes
        activations = self.activation_bytes(config, model, tokens, recompute, held) * scale
        if stage == config.pp - 1:
            activations += logit_bytes(model, config, tokens)
        return activations

    def cap(
        self,
        config: ParallelConfig,
        model: ModelSpec,
        num_gpus: int,
        recompute: bool = False,
        micro_batches: int | None = None,
    ) -> int:
        """Most tokens (a multiple of 128) of a micro-batch whose every rank's peak fits beside the margin and context.

        A rank's peak is `rank_memory`'s, the runtime's own prediction, in the compute dtype the caps are
        for: its parameters, gradients and owned optimizer state, the activations of the micro-batches
        its stage holds in flight and (last stage) the logits, and beside them the exchange's buffers (it
        overlaps compute). The profile's static state counts where it is larger. `micro_batches`: the
        replica's count; None, any count of at least two (stage s holds pp - s of them, `in_flight`);
        1, the replica's lone micro-batch (`lone_cap`: a deep replica holds it once, not pp times).
        The first and the last stage bind (embedding; head and logits). 0 where not even the state
        and the exchange's buffers fit. Under CP a rank holds ceil(T/cp) + 2cp tokens of T plus the
        K/V attention keeps (`kv_buffer_bytes`), so the cap is about cp x the per-rank one, less those.
        """
        count = max(2, config.pp) if micro_batches is None else micro_batches
        budget = self.usable_bytes
        static = self.static_bytes(config, model, num_gpus)
        bucket = int(self.exchange_bytes // 2)
        dtype = self.compute_dtype_bytes
        caps = []
        for stage in sorted({0, config.pp - 1}):
            rank = rank_memory(self, model, config, stage, num_gpus, 0, dtype, bucket, recompute, count)
            held = rank.params + rank.owned + max(0.0, static - (rank.params + rank.owned + rank.grads))
            if held + rank.after > budget:
                return 0  # not even the state and the exchange's buffers fit
            free = budget - held - rank.beside_activations

            def used(tokens: int, stage: int = stage) -> float:
                return self.stage_activation_bytes(config, model, stage, tokens, dtype, recompute, count)

            caps.append(_most_tokens(used, free))
        return min(caps) // CAP_GRANULARITY * CAP_GRANULARITY

    def state_bytes(self, config: ParallelConfig, model: ModelSpec, num_gpus: int) -> float:
        """What the fullest stage of `config` holds before any activation: parameters, gradients, owned
        optimizer state and the exchange's buffers (the phase after backward), in the compute dtype."""
        bucket = int(self.exchange_bytes // 2)
        static = self.static_bytes(config, model, num_gpus)
        most = 0.0
        for stage in sorted({0, config.pp - 1}):
            rank = rank_memory(self, model, config, stage, num_gpus, 0, self.compute_dtype_bytes, bucket)
            held = rank.params + rank.owned + max(0.0, static - (rank.params + rank.owned + rank.grads))
            most = max(most, held + rank.after)
        return most

    @property
    def usable_bytes(self) -> float:
        """What a rank's tensors may hold: the memory less the safety margin and the runtime's context."""
        return self.memory_bytes - self.safety_margin_bytes - self.context_overhead_bytes


def _most_tokens(used: Callable[[int], float], free: float) -> int:
    """The largest T with used(T) <= free, for `used` nondecreasing and affine but for CP's rounding."""
    if used(0) > free:
        return 0
    probe = 1 << 20
    slope = (used(probe) - used(0)) / probe
    tokens = max(0, int((free - used(0)) / slope))
    while tokens > 0 and used(tokens) > free:
        tokens -= 1
    while used(tokens + 1) <= free:
        tokens += 1
    return tokens


def head_is_embedding(model: ModelSpec, config: ParallelConfig) -> bool:
    """A tied head on a single stage is the embedding itself; a later stage of a tied model holds its own copy."""
    return model.arch.tied_embeddings and config.pp == 1


def layer_shard_params(model: ModelSpec, tp: int) -> int:
    """Elements of one transformer block on one TP rank: Q, O and the SwiGLU split, K and V split (or whole on
    every rank when tp exceeds the KV heads), Qwen2's q/k/v biases with their rows, norms replicated."""
    h, bias = model.hidden, int(model.arch.qkv_bias)
    q_dim, kv_dim = model.heads * model.head_dim, model.kv_heads * model.head_dim
    kv_split = tp if model.kv_heads % tp == 0 else 1
    n = (q_dim * (h + bias) + q_dim * h + 3 * h * model.ffn) // tp + 2 * kv_dim * (h + bias) // kv_split + 2 * h
    return n + (2 * model.head_dim if model.arch.qk_norm else 0)


def shard_params(model: ModelSpec, config: ParallelConfig, stage: int) -> int:
    """Compute-shard elements one rank holds: its stage's layers, plus the embedding on the first stage and
    the final norm and head on the last (none of its own for a tied single stage: `head_is_embedding`)."""
    h, v = model.hidden, model.vocab_rows
    n = model.layers // config.pp * layer_shard_params(model, config.tp)
    if stage == 0:
        n += v * h // config.tp
    if stage == config.pp - 1:
        n += h + (0 if head_is_embedding(model, config) else v * h // config.tp)
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
    def after(self) -> float:
        """What the phase after the backward adds to the parameters and owned state."""
        return self.grads + max(self.exchange, self.step)

    @property
    def beside_activations(self) -> float:
        """What the activations meet: the gradients already allocated and, as the exchange overlaps compute
        (runtime/overlap.py), its buffers."""
        return self.grads_with_activations + self.exchange

    @property
    def peak(self) -> float:
        return self.params + self.owned + max(self.activations + self.beside_activations, self.after)


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
    state = TrainingState.for_dtype(dtype_bytes)
    if micro_batches > 1 or config.pp > 1:
        grads_with_activations = shard * state.grad_bytes
    elif stage == config.pp - 1:
        grads_with_activations = model.vocab_rows * model.hidden / config.tp * state.grad_bytes
    else:
        grads_with_activations = 0.0
    owned = -(-model.num_params // num_gpus)
    return RankMemory(
        params=shard * state.param_bytes,
        grads=shard * state.grad_bytes,
        owned=owned * state.sharded_bytes,
        activations=memory.stage_activation_bytes(config, model, stage, tokens, dtype_bytes, recompute, micro_batches),
        grads_with_activations=grads_with_activations,
        # A buffer holds at most one bucket and at most what the rank moves: its shard, or the owned range
        # once per replica (a homogeneous pool's count of this config's replicas).
        exchange=2 * min(bucket_bytes, 4 * max(shard, owned * max(1, num_gpus // config.num_gpus))),
        step=min(bucket_bytes, owned * 4),
    )
