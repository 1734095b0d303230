"""What one rank holds of the model: its compute shard's elements, stage by stage and TP rank by TP rank, and
the bytes of training state per parameter (`TrainingState`) it keeps of them and of its owned shard.

The memory model (memory.py) and the runtime's shard specs (tests/runtime/test_memory_shard.py checks them
against the built stage models) count the same elements; the memory model, the analytic and measured
profiles and the runtime's prediction of its peak read the one `TrainingState`; numpy only.
"""

from __future__ import annotations

from dataclasses import dataclass

from hydraulis.parallel import ParallelConfig
from hydraulis.specs import ModelSpec


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
class TrainingState:
    """Bytes per parameter of training state, exactly as the runtime holds it (runtime/optimizer/sharded.py).

    With the compute shard (replicated across replicas): parameters in the compute dtype and the sum of their
    gradients over the micro-batches, in as many bytes (under bf16 a scaled fp16 sum, runtime/modeling/main_grad.py).
    Sharded over all N ranks (the owner shards): fp32 master weights and two fp32 AdamW moments, held throughout,
    and the reduced gradient, which exists from the reduce to the step (runtime/optimizer/sharded.py's
    OwnedGradient). The analytic memory model and `rank_memory` both read this one definition; bf16 by default.
    """

    param_bytes: int = 2
    grad_bytes: int = 2
    master_bytes: int = 4
    moment_bytes: int = 8
    reduced_grad_bytes: int = 2

    @classmethod
    def for_dtype(cls, dtype_bytes: int) -> TrainingState:
        """The state under a compute dtype of `dtype_bytes` bytes (under bf16 the reduced gradient is a 2-byte
        scaled sum too, runtime/optimizer/sharded.py's OwnedGradient)."""
        return cls(param_bytes=dtype_bytes, grad_bytes=dtype_bytes, reduced_grad_bytes=dtype_bytes)

    @property
    def scaled(self) -> bool:
        """Whether the reduced gradient is a scaled fp16 sum, summed per round in an fp32 scratch."""
        return self.reduced_grad_bytes < 4

    @property
    def replicated_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes

    @property
    def sharded_bytes(self) -> int:
        return self.held_sharded_bytes + self.reduced_grad_bytes

    @property
    def held_sharded_bytes(self) -> int:
        """The owned state held throughout: fp32 master weights and moments (not the reduced gradient)."""
        return self.master_bytes + self.moment_bytes

    @property
    def total_bytes(self) -> int:
        return self.replicated_bytes + self.sharded_bytes

    @property
    def sharded_fraction(self) -> float:
        """The memory model's optimizer_sharded_fraction (alpha)."""
        return self.sharded_bytes / self.total_bytes
