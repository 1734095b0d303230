"""The cost model interface: time of a micro-batch, memory cap, busy threshold.

Time of one packed micro-batch (lengths s_i) on one pipeline stage of config g,
forward plus backward (docs/design.md, section 4):

    t_g(mb) = a_g * sum(s_i^2) + b_g * sum(s_i) + c_g

Subclasses only supply the coefficients per config and the memory constants;
everything else, vectorised, lives here so that every consumer (planner,
simulator, baselines, proposal) costs things the same way.

Context parallelism (cp > 1) splits every sequence of a micro-batch over cp
GPUs: a and b divide by cp, and the K/V exchange over the CP group (an
all-gather per layer forward, a reduce-scatter of dK/dV backward) adds to b
and c (`kv_exchange`). `extend_to_cp` derives cp > 1 entries from measured
cp = 1 ones (an analytic extension, labelled `+cp`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from hydraulis.context import max_rank_tokens
from hydraulis.errors import HydraulisError
from hydraulis.limits import MAX_GPUS
from hydraulis.parallel import ParallelConfig
from hydraulis.specs import DeviceSpec, ModelSpec

CAP_GRANULARITY = 128
RECOMPUTE_INPUT_BYTES = 2  # a layer's input kept under full recompute (bf16)
RECOMPUTE_TIME = 4 / 3  # training is 4 forwards instead of 3 when each layer's forward runs twice
KV_BYTES = 2  # K and V travel over the CP group in the compute dtype (bf16)
# CP degrees the cost models offer. CP serves long sequences, whose activation memory pipeline stages do
# not lower (1F1B keeps L layers' worth in flight), so it is combined with pp <= CP_MAX_PP only.
CP_DEGREES = (2, 4, 8, 16)
CP_MAX_PP = 2
CP_SUFFIX = "+cp"


def sequence_costs(a: float | np.ndarray, b: float | np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """a*s^2 + b*s: what each sequence adds to a micro-batch's stage time (c is per micro-batch).

    `a` and `b` broadcast against the lengths: scalars for one config, [configs, 1] columns for a matrix.
    """
    s = np.asarray(lengths, dtype=np.float64)
    return a * s * s + b * s


def kv_shard_dim(model: ModelSpec, tp: int) -> int:
    """K (or V) columns one TP rank holds: its share of the KV heads, one whole head when tp > kv_heads."""
    return model.kv_heads * model.head_dim // min(tp, model.kv_heads)


def kv_exchange_bytes(model: ModelSpec, config: ParallelConfig) -> float:
    """Bytes one rank moves per token of a micro-batch, one stage, forward plus backward, for CP.

    Forward all-gathers each layer's K and V over the CP group (a rank receives the (cp - 1) / cp it
    lacks of its TP shard); backward reduce-scatters dK and dV, the same bytes again.
    """
    if config.cp == 1:
        return 0.0
    layers = model.layers / config.pp
    return 2 * 2 * layers * kv_shard_dim(model, config.tp) * KV_BYTES * (config.cp - 1) / config.cp


def kv_exchange(model: ModelSpec, device: DeviceSpec, config: ParallelConfig) -> tuple[float, float]:
    """(b, c) seconds the K/V exchange adds per token and per micro-batch: NVLink inside a node, the NIC
    when the CP group spans nodes; a ring of cp - 1 steps pays cp - 1 latencies per collective."""
    if config.cp == 1:
        return 0.0, 0.0
    spans = config.cp_spans_nodes(device.gpus_per_node)
    bandwidth = device.inter_node_bw if spans else device.intra_node_bw
    collectives = 2 * model.layers / config.pp
    return kv_exchange_bytes(model, config) / bandwidth, collectives * (config.cp - 1) * device.p2p_latency_s


def kv_buffer_bytes(model: ModelSpec, config: ParallelConfig, recompute: bool = False) -> float:
    """Bytes per token of a micro-batch that CP adds on a rank, beyond its share of the activations.

    Each chunk of a split document attends to the gathered keys and values up to its end, and
    attention keeps that copy for backward: about (1 + 1 / 2cp) x the document's K/V per layer, for
    every layer in flight (L under 1F1B, one under full recompute). On top, one layer's gathered K/V
    and their gradients are live while it runs.
    """
    if config.cp == 1:
        return 0.0
    per_layer = 2 * kv_shard_dim(model, config.tp) * KV_BYTES
    kept_layers = 1 if recompute else model.layers
    return kept_layers * per_layer * (1 + 1 / (2 * config.cp)) + 2 * per_layer


def cp_configs(base: Sequence[ParallelConfig], max_gpus: int = MAX_GPUS) -> list[ParallelConfig]:
    """The CP configs built on cp = 1 ones: each CP_DEGREES degree on each base with pp <= CP_MAX_PP."""
    return [
        ParallelConfig(g.tp, g.pp, cp)
        for g in base
        if g.cp == 1 and g.pp <= CP_MAX_PP
        for cp in CP_DEGREES
        if g.num_gpus * cp <= max_gpus
    ]


@dataclass(frozen=True)
class Coefficients:
    """Seconds: a per squared token, b per token, c per micro-batch (one stage, fwd+bwd)."""

    a: float
    b: float
    c: float


@dataclass(frozen=True)
class TrainingState:
    """Bytes per parameter of training state, exactly as the runtime holds it (runtime/optimizer.py).

    With the compute shard (replicated across replicas): parameters and
    gradients in the compute dtype. Sharded over all N ranks (the fixed
    optimizer layout): fp32 master weights, two fp32 AdamW moments and the
    fp32 reduced gradient. The analytic memory model and the runtime's memory
    test both read this one definition.
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
        """What a GPU has left for activations after the margin, the context and the static state."""
        return (
            self.memory_bytes
            - self.safety_margin_bytes
            - self.context_overhead_bytes
            - self.static_bytes(config, model, num_gpus)
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
            return 0
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


@dataclass(frozen=True)
class Link:
    """A measured link: t = latency_s + bytes / bandwidth_Bps."""

    latency_s: float
    bandwidth_Bps: float

    def time(self, num_bytes: float) -> float:
        return self.latency_s + num_bytes / self.bandwidth_Bps


@dataclass(frozen=True)
class Collectives:
    """Links measured by `hydraulis profile` on one node of `world_size` ranks; None where not measured.

    all_to_all: the optimizer's gather and reduce (`all_to_all_single` with
    split sizes), bytes = what one rank sends to the others; p2p: one
    pipeline activation transfer between neighbouring ranks.
    """

    world_size: int
    all_to_all: Link | None = None
    p2p: Link | None = None


@dataclass(frozen=True)
class SharedCores:
    """CPU ranks that share `cores` cores, and how many computed at once when each config was measured.

    Why: with more ranks than cores (gloo on a laptop) a replica's time depends on how many
    ranks compute beside it, and a plan that leaves replicas idle runs the busy ones faster.
    Processor sharing: k busy ranks of `threads_per_rank` threads each are slowed by
    max(1, k * threads / cores), so a time measured at one load is rescaled to another, and
    as replicas finish the others speed up (`finish_times`).
    """

    cores: int
    threads_per_rank: int
    busy_ranks: dict[ParallelConfig, int]  # ranks computing at once while the config was measured

    def load(self, busy: int) -> float:
        return max(1.0, busy * self.threads_per_rank / self.cores)

    def finish_times(self, configs: Sequence[ParallelConfig], times: np.ndarray) -> np.ndarray:
        """When each replica finishes if they start together and share the cores (fluid processor sharing).

        `times` are the replicas' times at the load their configs were measured under. Each replica
        has that much work at its measured speed; while B ranks are busy, all progress at
        1 / load(B) of the cores' full speed, and a replica that finishes frees its cores for the rest.
        A config measured without sharing keeps its time (its ranks still count as busy).
        """
        times = np.asarray(times, dtype=np.float64)
        ranks = np.array([c.num_gpus for c in configs], dtype=np.float64)
        measured = [self.busy_ranks.get(c) for c in configs]
        work = np.array([t / self.load(m) if m is not None else t for t, m in zip(times, measured, strict=True)])
        finish = np.zeros_like(times)
        remaining = work.copy()
        active = remaining > 0
        now = 0.0
        while active.any():
            rate = 1.0 / self.load(int(ranks[active].sum()))
            dt = remaining[active].min() / rate
            now += dt
            remaining[active] -= dt * rate
            done = active & (remaining <= 1e-12 * work.max())
            finish[done] = now
            active &= ~done
        unshared = np.array([m is None for m in measured])
        finish[unshared] = times[unshared]
        return finish


@dataclass(frozen=True)
class OptimizerStep:
    """The trainer's phase after compute (gather, gradient reduce, norm, AdamW), measured per config.

    Seconds on a deployment of each config filling a job of `world_size`
    ranks; a deployment costs its slowest config's (the exchange waits for it).
    """

    world_size: int
    seconds: dict[ParallelConfig, float]


class CostModel:
    """Coefficients per config, a memory model, and the vectorised costing built on them."""

    def __init__(
        self,
        name: str,
        model: ModelSpec,
        device: DeviceSpec,
        coefficients: dict[ParallelConfig, Coefficients],
        memory: MemoryModel,
        min_efficient_tokens: dict[int, int],
        collectives: Collectives | None = None,
        shared_cores: SharedCores | None = None,
        optimizer_step: OptimizerStep | None = None,
    ) -> None:
        if not coefficients:
            raise HydraulisError(f"cost model {name!r} has no parallel configs")
        self.name = name
        self.model = model
        self.device = device
        self.memory = memory
        self.collectives = collectives  # measured links replace the device constants within a node
        self.shared_cores = shared_cores  # CPU profiles: the simulator rescales times by the ranks busy at once
        self.optimizer_step = optimizer_step  # measured step after compute; else grad_sync_time's estimate
        self._min_efficient = dict(min_efficient_tokens)
        self.configs: tuple[ParallelConfig, ...] = tuple(
            sorted(coefficients, key=lambda c: (c.num_gpus, c.tp, c.pp, c.cp))
        )
        self._index = {c: i for i, c in enumerate(self.configs)}
        self.a = np.array([coefficients[c].a for c in self.configs])
        self.b = np.array([coefficients[c].b for c in self.configs])
        self.c = np.array([coefficients[c].c for c in self.configs])
        self.recompute: frozenset[ParallelConfig] = frozenset()

    def with_recompute(self, configs: Iterable[ParallelConfig]) -> CostModel:
        """A copy in which these configs recompute activations: a larger cap, a and b x RECOMPUTE_TIME.

        The runtime checkpoints every transformer block of exactly these configs' replicas, so
        the planner's caps and times describe what runs.
        """
        new = frozenset(configs) - self.recompute
        out = copy.copy(self)
        idx = [self.index(g) for g in new]
        out.a, out.b = self.a.copy(), self.b.copy()
        out.a[idx] *= RECOMPUTE_TIME
        out.b[idx] *= RECOMPUTE_TIME
        out.recompute = self.recompute | new
        return out

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, {len(self.configs)} configs)"

    # -- coefficients -------------------------------------------------------
    def index(self, config: ParallelConfig) -> int:
        try:
            return self._index[config]
        except KeyError:
            known = ", ".join(c.name for c in self.configs)
            raise HydraulisError(f"cost model {self.name!r} has no config {config.name}; it knows {known}") from None

    def coefficients(self, config: ParallelConfig) -> Coefficients:
        i = self.index(config)
        return Coefficients(float(self.a[i]), float(self.b[i]), float(self.c[i]))

    # -- time -----------------------------------------------------------------
    def stage_time(self, config: ParallelConfig, lengths: Sequence[int] | np.ndarray) -> float:
        """Forward+backward seconds of one packed micro-batch on one stage."""
        i = self.index(config)
        s = np.asarray(lengths, dtype=np.float64)
        return float(self.a[i] * np.dot(s, s) + self.b[i] * s.sum() + self.c[i])

    def seq_costs(self, config: ParallelConfig, lengths: np.ndarray) -> np.ndarray:
        """a*s^2 + b*s per sequence: the part of stage time each sequence adds (no c)."""
        i = self.index(config)
        return sequence_costs(self.a[i], self.b[i], lengths)

    def cost_matrix(self, lengths: np.ndarray, configs: Sequence[ParallelConfig] | None = None) -> np.ndarray:
        """[configs x sequences] of a*s^2 + b*s, in one vectorised expression."""
        idx = np.array([self.index(c) for c in configs]) if configs is not None else np.arange(len(self.configs))
        return sequence_costs(self.a[idx, None], self.b[idx, None], np.asarray(lengths)[None, :])

    # -- memory -----------------------------------------------------------------
    def cap(self, config: ParallelConfig, num_gpus: int) -> int:
        """Most tokens one micro-batch may hold on `config` in a job of `num_gpus`."""
        return self.memory.cap(config, self.model, num_gpus, config in self.recompute)

    def caps(self, num_gpus: int) -> dict[ParallelConfig, int]:
        return {c: self.cap(c, num_gpus) for c in self.configs if c.num_gpus <= num_gpus}

    def min_efficient_tokens(self, config: ParallelConfig) -> int:
        """Fewest tokens a micro-batch needs to keep the GPU busy (under CP, each of its cp ranks)."""
        table = self._min_efficient
        if not table:
            return 0
        if config.tp in table:
            return table[config.tp] * config.cp
        keys = sorted(table)
        below = [k for k in keys if k <= config.tp]
        return (table[below[-1]] if below else table[keys[0]]) * config.cp

    # -- communication ---------------------------------------------------------
    def p2p_time(self, config: ParallelConfig, tokens: int) -> float:
        """One stage boundary crossing of a micro-batch's activations (bf16), one way."""
        measured = self.collectives.p2p if self.collectives is not None else None
        share = tokens * self.model.hidden * 2 / (config.tp * config.cp)  # each CP rank sends its share
        if measured is not None and config.num_gpus <= self.device.gpus_per_node:
            return measured.time(share)
        bandwidth = (
            self.device.inter_node_bw if config.num_gpus > self.device.gpus_per_node else self.device.intra_node_bw
        )
        return self.device.p2p_latency_s + share / bandwidth

    def grad_sync_time(self, num_gpus: int) -> float:
        """Reduce gradients into the sharded optimizer layout and gather parameters back.

        About 2 x parameter bytes (bf16) / N per GPU at the slowest link (docs/design.md, section 4). A
        profile's measured all-to-all link replaces the device constants within a node (one
        gather plus one reduce, each paying its latency); across nodes the constants stay.
        """
        if num_gpus <= 1:
            return 0.0
        measured = self.collectives.all_to_all if self.collectives is not None else None
        if measured is not None and num_gpus <= self.device.gpus_per_node:
            return 2 * measured.time(2 * self.model.num_params / num_gpus)
        bandwidth = self.device.inter_node_bw if num_gpus > self.device.gpus_per_node else self.device.intra_node_bw
        return 2 * (2 * self.model.num_params) / num_gpus / bandwidth

    def step_time(self, configs: Sequence[ParallelConfig]) -> float:
        """Seconds after compute of an iteration on a deployment of these configs: measured where profiled.

        A profile's measured optimizer step (same world size, every config
        measured) counts the gather, the reduce, the norm and AdamW as the
        trainer runs them; otherwise the exchange estimate of grad_sync_time.
        """
        num_gpus = sum(c.num_gpus for c in configs)
        step = self.optimizer_step
        if step is not None and step.world_size == num_gpus and all(c in step.seconds for c in configs):
            return max(step.seconds[c] for c in configs)
        return self.grad_sync_time(num_gpus)


def extend_to_cp(
    cost: CostModel, degrees: Sequence[int] = CP_DEGREES, only: Callable[[ParallelConfig], bool] | None = None
) -> CostModel:
    """`cost` plus cp > 1 configs derived analytically from its cp = 1 entries (named NAME+cp).

    A CP config splits every sequence over cp ranks: a / cp and b / cp of the measured (tp, pp), plus
    the K/V exchange (`kv_exchange`) at the device's bandwidths. Entries the cost model already has
    (measured cp > 1) are kept as they are. The recompute set carries over to the derived configs.
    `only`, if given, chooses which derived configs to add (a benchmark's CP-only-where-needed model).
    """
    if cost.name.endswith(CP_SUFFIX):
        return cost
    coefficients = {g: cost.coefficients(g) for g in cost.configs}
    recompute = set(cost.recompute)
    for g in cp_configs(cost.configs):
        if g.cp not in degrees or g in coefficients or (only is not None and not only(g)):
            continue
        base = ParallelConfig(g.tp, g.pp)
        k = coefficients[base]
        db, dc = kv_exchange(cost.model, cost.device, g)
        scale = RECOMPUTE_TIME if base in cost.recompute else 1.0  # the exchange is rerun with the forward
        coefficients[g] = Coefficients(k.a / g.cp, k.b / g.cp + db * scale, k.c + dc)
        if base in cost.recompute:
            recompute.add(g)
    out = copy.copy(cost)
    CostModel.__init__(
        out,
        cost.name + CP_SUFFIX,
        cost.model,
        cost.device,
        coefficients,
        cost.memory,
        dict(cost._min_efficient),
        cost.collectives,
        cost.shared_cores,
        cost.optimizer_step,
    )
    out.recompute = frozenset(recompute)
    return out
