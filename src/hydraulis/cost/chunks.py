"""Chunked long sequences, as an oracle (issue 42, item 3): what running a long sequence in chunks on one
replica, in order, each chunk attending to the keys and values its predecessors left (ChunkFlow,
InfiniPipe), could gain beyond recompute and CP. No plan runs chunks; the bench's bound takes them as one
more way to run a sequence (`planner.bounds.lower_bound(chunked=True)`), and `benchmarks/chunk_oracle.py`
compares the bounds.

A sequence of s tokens beyond a config's cap runs there as K = ceil(s / C) chunks of C tokens. Causal
attention over the prefix makes the chunks' work the whole sequence's, a s^2 + b s per stage, plus a
micro-batch's fixed cost c per chunk. Memory: a chunk's activations as a micro-batch of C tokens, beside
the K/V of the whole sequence on every layer of the stage (what the last chunk attends to), so
C + kappa s <= cap, kappa being the K/V's bytes per token over the activations' bytes per token that the
cap counts. The backward runs the chunks in reverse after all their forwards, and memory holds only C
tokens' activations: the forward of the other s - C tokens runs again (ChunkFlow's recompute), a
FORWARD_SHARE of their work. (Holding N chunks of C / N recomputes as much and pays more c, so one chunk
of the largest C is the best.) A chunk below the config's busy threshold (`min_efficient_tokens`) is not
offered. Optimistic in one respect, so an upper bound on the gain: the chunks of one sequence cross the
pipeline as if their bubbles were filled by other work (all forwards first, then all backwards, leaves
(pp - 1) chunk-stages idle at each end).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hydraulis.cost.activations import KV_BYTES, kv_shard_dim
from hydraulis.cost.model import FORWARD_SHARE, CostModel
from hydraulis.parallel import ParallelConfig

CHUNK_GRANULARITY = 128  # tokens: a chunk is a multiple of this, like a cap


def kv_share(cost: CostModel, config: ParallelConfig) -> float:
    """kappa: the K/V one token leaves on a stage's layers over the activation bytes per token the cap counts
    (both per CP rank's share; the configs that recompute keep only each layer's input)."""
    model = cost.model
    kv = 2 * kv_shard_dim(model, config.tp) * KV_BYTES * (model.layers // config.pp)
    return kv / cost.memory.bytes_per_token(config, model, recompute=cost.recomputes(config))


def chunk_sizes(
    cost: CostModel, configs: Sequence[ParallelConfig], num_gpus: int, lengths: np.ndarray
) -> np.ndarray:
    """[configs x sequences]: the largest chunk (a multiple of CHUNK_GRANULARITY) with which each config runs
    each sequence, C + kappa s <= cap; the sequence itself where it fits the cap; 0 where not even a chunk of
    CHUNK_GRANULARITY fits beside its K/V."""
    lengths = np.asarray(lengths, dtype=np.int64)
    cap = np.array([cost.cap(g, num_gpus) for g in configs], dtype=np.float64)[:, None]
    kappa = np.array([kv_share(cost, g) for g in configs])[:, None]
    room = (cap - kappa * lengths[None, :]) // CHUNK_GRANULARITY * CHUNK_GRANULARITY
    chunk = np.where(room >= CHUNK_GRANULARITY, room, 0.0)
    return np.where(lengths[None, :] <= cap, lengths[None, :], chunk).astype(np.int64)


def chunked_stage_time(
    cost: CostModel, configs: Sequence[ParallelConfig], num_gpus: int, lengths: np.ndarray
) -> np.ndarray:
    """[configs x sequences]: one stage's time for each sequence beyond the config's cap run there in chunks
    (module docstring): a s^2 + b s, FORWARD_SHARE of the work of all but the last chunk's tokens again, and
    c per chunk; inf where the sequence fits the cap (no chunks needed) or no busy chunk fits beside its K/V."""
    lengths = np.asarray(lengths, dtype=np.int64)
    chunk = chunk_sizes(cost, configs, num_gpus, lengths).astype(np.float64)
    busy = np.array([max(cost.min_efficient_tokens(g), CHUNK_GRANULARITY) for g in configs])[:, None]
    cap = np.array([cost.cap(g, num_gpus) for g in configs])[:, None]
    runs = (lengths[None, :] > cap) & (chunk >= busy)
    c = np.array([cost.coefficients(g).c for g in configs])[:, None]
    w = cost.cost_matrix(lengths, configs)
    size = np.where(runs, chunk, 1.0)
    again = FORWARD_SHARE * w * np.clip(1.0 - size / lengths[None, :], 0.0, 1.0)
    return np.where(runs, w + again + np.ceil(lengths[None, :] / size) * c, np.inf)
