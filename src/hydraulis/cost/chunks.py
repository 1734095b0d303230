"""Chunked long sequences, as an oracle (issue 42, item 3): what running a long sequence in chunks on one
replica, in order, each chunk attending to the keys and values its predecessors left (ChunkFlow,
InfiniPipe), could gain beyond recompute and CP. No plan runs chunks; the bench's bound takes them as one
more way to run a sequence (`planner.bounds.lower_bound(chunked=True)`), `benchmarks/chunk_oracle.py`
compares the bounds, and `planner/oracles/chunk_schedule.py` runs the chunks' real order on the pipeline.

A sequence of s tokens beyond a config's lone cap (what a lone micro-batch holds whole) runs there in a pass
of its own under one of the config's memory policies (the least time), as K = ceil(s / C) chunks, the
last C tokens (the attention-heaviest, never recomputed) and the first the remainder. Causal attention
over the prefix makes the chunks' work the whole sequence's, a s^2 + b s per stage, plus a micro-batch's
fixed cost c per chunk. Memory, as a replica's lone micro-batch (`CostModel.lone_cap`): one chunk's
activations beside what the whole sequence leaves on every layer of the stage: its K/V, the gradient of
the K/V accumulating from later chunks (held until its chunk's backward), each virtual stage's input of
every chunk (for the recompute) and, under CP, the gathered K/V that blockwise attention keeps
(`kv_buffer_bytes`, for the whole prefix), so C + kappa s <= the lone cap (`kv_share`). The backward
runs the chunks in reverse after all their forwards, and memory holds only one chunk's activations: the
forward of every chunk but the last runs again (ChunkFlow's recompute), FORWARD_SHARE of the work of the
first s - C tokens and of c per chunk. (Holding N chunks of C / N recomputes as much and pays more c, so
one chunk of the largest C is the best.) A chunk below the config's busy threshold
(`min_efficient_tokens`) is not offered. Optimistic in one respect, so a bound on the gain: the chunks of
one sequence cross the pipeline as if their bubbles were filled by other work (all forwards first, then
all backwards, leaves (pp - 1) chunk-stages idle at each end; `planner/oracles/chunk_schedule.py` counts them).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hydraulis.cost.activations import KV_BYTES, kv_buffer_bytes, kv_shard_dim
from hydraulis.cost.model import FORWARD_SHARE, CostModel, sequence_costs
from hydraulis.cost.policies import MemoryPolicy
from hydraulis.parallel import ParallelConfig

CHUNK_GRANULARITY = 128  # tokens: a chunk is a multiple of this, like a cap
INPUT_BYTES = 2  # a virtual stage's input per token and hidden unit, kept for the recompute (bf16)


def lone_cap(cost: CostModel, config: ParallelConfig, num_gpus: int, policy: MemoryPolicy | None = None) -> int:
    """The tokens a chunk's pass may hold: the config's lone micro-batch under `policy` (None: its plain one)."""
    return cost.policy_cap(config, num_gpus, cost.policies(config)[0] if policy is None else policy, 1)


def kv_share(cost: CostModel, config: ParallelConfig, policy: MemoryPolicy | None = None) -> float:
    """kappa: the bytes one token of the whole sequence leaves on a rank beside a chunk (its K/V and their
    gradient on the stage's layers and each virtual stage's input, per CP rank's share; the gathered K/V
    under CP, whole) over the bytes per token of a lone micro-batch's activations under `policy` (module
    docstring)."""
    model, held = cost.model, config.vp  # a lone micro-batch: vp chunks of L / (pp vp) layers
    policy = cost.policies(config)[0] if policy is None else policy
    kv = 2 * kv_shard_dim(model, config.tp) * KV_BYTES * (model.layers // config.pp)
    inputs = config.vp * model.hidden * INPUT_BYTES
    gathered = kv_buffer_bytes(model, config, policy, held)
    per_token = cost.memory.bytes_per_token(config, model, policy, held) / config.cp
    return ((2 * kv + inputs) / config.cp + gathered) / (per_token + gathered)


def chunk_sizes(
    cost: CostModel, configs: Sequence[ParallelConfig], num_gpus: int, lengths: np.ndarray,
    policy: MemoryPolicy | None = None,
) -> np.ndarray:
    """[configs x sequences]: the largest chunk (a multiple of CHUNK_GRANULARITY) with which each config runs
    each sequence in its own pass under `policy` (None: each config's plain one), C + kappa s <= lone cap;
    the sequence itself where it fits the lone cap; 0 where not even a chunk of CHUNK_GRANULARITY fits beside
    its K/V, or the config may not run `policy`."""
    lengths = np.asarray(lengths, dtype=np.int64)
    may = np.array([policy is None or policy in cost.policies(g) for g in configs])[:, None]
    cap = np.array([lone_cap(cost, g, num_gpus, policy) if ok else 0 for g, ok in zip(configs, may[:, 0],
                                                                                        strict=True)])[:, None]
    room = chunk_room(cost, configs, num_gpus, lengths, policy)
    return np.where(may, np.where(lengths[None, :] <= cap, lengths[None, :], room), 0).astype(np.int64)


def chunk_room(
    cost: CostModel, configs: Sequence[ParallelConfig], num_gpus: int, lengths: np.ndarray,
    policy: MemoryPolicy | None = None,
) -> np.ndarray:
    """[configs x sequences]: the largest chunk (a multiple of CHUNK_GRANULARITY) beside each whole sequence's
    K/V, C + kappa s <= lone cap under `policy`; 0 where not even CHUNK_GRANULARITY fits."""
    lengths = np.asarray(lengths, dtype=np.int64)
    cap = np.array([lone_cap(cost, g, num_gpus, policy) if policy is None or policy in cost.policies(g) else 0
                    for g in configs], dtype=np.float64)[:, None]
    kappa = np.array([kv_share(cost, g, policy) for g in configs])[:, None]
    room = (cap - kappa * lengths[None, :]) // CHUNK_GRANULARITY * CHUNK_GRANULARITY
    return np.where(room >= CHUNK_GRANULARITY, room, 0.0).astype(np.int64)


def chunked_stage_time(
    cost: CostModel, configs: Sequence[ParallelConfig], num_gpus: int, lengths: np.ndarray,
    policy: MemoryPolicy | None = None,
) -> np.ndarray:
    """[configs x sequences]: one stage's time for each sequence beyond the config's cap run there in chunks
    (module docstring) under `policy`, or None: the least over the memory policies each config may run. Its
    a s^2 + b s, c per chunk, and FORWARD_SHARE of the first s - C tokens' work and of c per chunk but the
    last again; inf where the sequence fits the cap (no pass of its own needed) or the lone cap (a lone
    micro-batch runs it whole: the bound's own case), or no busy chunk fits beside its K/V."""
    if policy is None:
        policies = dict.fromkeys(p for g in configs for p in cost.policies(g))
        return np.min([chunked_stage_time(cost, configs, num_gpus, lengths, p) for p in policies], axis=0)
    lengths = np.asarray(lengths, dtype=np.int64)
    chunk = chunk_sizes(cost, configs, num_gpus, lengths, policy).astype(np.float64)
    busy = np.array([max(cost.min_efficient_tokens(g), CHUNK_GRANULARITY) for g in configs])[:, None]
    cap = np.array([cost.cap(g, num_gpus) for g in configs])[:, None]
    runs = (lengths[None, :] > cap) & (chunk < lengths[None, :]) & (chunk >= busy)  # beyond the lone cap too
    size = np.where(runs, chunk, 1.0)
    k = np.ceil(lengths[None, :] / size)
    coef = [cost.coefficients(g) for g in configs]
    scale = np.array([cost.policy_scale(g, policy) for g in configs])
    a = np.array([x.a for x in coef])[:, None] * scale[:, :1]
    b = np.array([x.b for x in coef])[:, None] * scale[:, 1:]
    c = np.array([x.c for x in coef])[:, None]
    prefix = np.maximum(lengths[None, :] - size, 0.0)
    work = sequence_costs(a, b, lengths[None, :]) + k * c
    again = FORWARD_SHARE * (sequence_costs(a, b, prefix) + (k - 1) * c)
    return np.where(runs, work + again, np.inf)
