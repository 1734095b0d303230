"""What one rank holds of the model: its compute shard's elements, stage by stage and TP rank by TP rank.

The memory model (memory.py) and the runtime's shard specs (tests/runtime/test_memory_shard.py checks them
against the built stage models) count the same elements; numpy only.
"""

from __future__ import annotations

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
