"""Memory: the training state the runtime holds, and the per-GPU cap it leaves for activations.

`TrainingState` (shards.py) is the one definition of bytes per parameter that the memory model and the
runtime's prediction of its peak both read; activations.py counts what the layers and loss head keep for backward;
`rank_memory` is one rank's peak buffer by buffer, logged beside the allocator's (runtime/metering/step_memory.py);
`MemoryModel.cap` (docs/design.md, section 4) is the largest micro-batch whose `rank_memory` peak fits on
the config's first and last stage: under CP with the K/V buffers attention keeps, zero where the state and
the exchange's buffers do not fit; under a memory policy (policies.py), its count.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from hydraulis.context import max_rank_tokens
from hydraulis.cost.activations import (
    COUNT_HORIZON,
    backward_bytes,
    chunk_grads,
    embedding_backward,
    gradients_beside,
    head_bytes,
    held_layers,
    in_flight,
    kept_share,
    kv_buffer_bytes,
    loss_transient_bytes,
    recomputed_bytes,
    reduce_chunks,
    reduce_start,
    stack_bytes,
    worst_counts,
)
from hydraulis.cost.policies import MemoryPolicy
from hydraulis.cost.shards import TrainingState, head_is_embedding, layer_shard_params, shard_params
from hydraulis.limits import DEFAULT_EXCHANGE_BUCKET_BYTES
from hydraulis.parallel import ParallelConfig
from hydraulis.specs import ModelSpec

CAP_GRANULARITY = 128
RECOMPUTE_INPUT_BYTES = 2  # a layer's input kept under full recompute (bf16), with a published activation factor
EXCHANGE_ELEMENT_BYTES = 4  # the exchange's rounds are sized for fp32 elements (runtime/optimizer/exchange_plan.py)
ACTIVATION_DTYPE_BYTES = 2  # a published activation factor is for bf16 unless its profile says otherwise
CAP_DTYPE_BYTES = 2  # the caps are for bf16 compute unless the job says otherwise
BUDGET_MARGIN = 0.1  # the largest share of a memory budget per rank kept as the safety margin
FIRST_PROBE, GUESSES = 1 << 17, 3  # where `_most_tokens` looks first (tokens: large configs' caps); lines from 0


@dataclass(frozen=True)
class MemoryModel:
    """Per-GPU memory of a config when optimizer states are sharded over all N GPUs.

    The activations are this runtime's own count (activations.py) unless a profile publishes another
    system's (`activation_bytes_per_token_hidden_layer`: its whole per-token activation memory, head and
    loss included, per layer and hidden / tp column in bf16, as the shipped A800 profiles do); the
    state, the exchange and what the loss head keeps whatever the tokens (the head's fp32 gradient sum,
    one chunk of logits) are always this runtime's. `compute_dtype_bytes` and `sequence_parallel` are the
    job's (bf16, no SP by default: `for_job`).
    """

    memory_bytes: int
    activation_bytes_per_token_hidden_layer: dict[int, float]  # empty: this runtime's own count
    state_bytes_per_hidden2_layer: float
    optimizer_sharded_fraction: float
    context_overhead_bytes: float
    safety_margin_bytes: float
    embedding_state_bytes: float = 16.0  # training-state bytes per embedding or head parameter (design section 4)
    # The exchange's buffers (optimizer/exchange_plan.py): two rounds in flight, each a send and a receive buffer of
    # half a bucket (two buckets in all), beside the first forward (the gather) and the last backward (the reduce).
    exchange_bytes: float = 2 * DEFAULT_EXCHANGE_BUCKET_BYTES
    activation_dtype_bytes: int = ACTIVATION_DTYPE_BYTES  # the published activation factors' dtype
    compute_dtype_bytes: int = CAP_DTYPE_BYTES  # the compute dtype the caps are for
    sequence_parallel: bool = False
    # A later phase of a phased iteration holds the earlier phases' reduced gradient beside its activations.
    reduced_held: bool = False
    budget_bytes: int | None = None  # [parallel] memory_per_rank (`for_job`): memory_bytes is then this budget

    def for_job(
        self, memory_bytes: int | None, dtype_bytes: int, bucket_bytes: int | None = None,
        sequence_parallel: bool = False,
    ) -> MemoryModel:
        """This model for a job's compute dtype, exchange bucket, sequence parallelism and, when given, memory
        budget per rank.

        The budget (`[parallel] memory_per_rank`) is what a rank's tensors may hold at their peak: what
        torch's allocator counts and what `torch.cuda.set_per_process_memory_fraction` limits on CUDA.
        The runtime's context lies outside it (no context overhead); the safety margin keeps its share
        of the memory, at most BUDGET_MARGIN, for the prediction's error and the allocator's slack.
        """
        out = replace(self, compute_dtype_bytes=dtype_bytes, sequence_parallel=sequence_parallel)
        if bucket_bytes is not None:
            out = replace(out, exchange_bytes=2 * bucket_bytes)
        if memory_bytes is None:
            return out
        share = self.safety_margin_bytes / self.memory_bytes if self.memory_bytes > 0 else 0.0
        return replace(
            out,
            memory_bytes=int(memory_bytes),
            budget_bytes=int(memory_bytes),
            context_overhead_bytes=0.0,
            safety_margin_bytes=min(share, BUDGET_MARGIN) * memory_bytes,
        )

    @property
    def exchange_bucket_bytes(self) -> int:  # the most bytes one buffer holds ([parallel] exchange_bucket_mb)
        return int(self.exchange_bytes // 2)

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
        self, config: ParallelConfig, model: ModelSpec, recompute: int = 0, held: int | None = None,
        dtype_bytes: int | None = None,
    ) -> float:
        """Bytes per token one rank's layers keep (under CP, per token of the rank's share), with `held`
        micro-batches of L/pp layers in flight (default pp, the first stage's in 1F1B: L layers in all), under
        the memory policy `recompute` (policies.MemoryPolicy; a bool reads as none or full)."""
        layers = held_layers(model, config, held)
        d = self.compute_dtype_bytes if dtype_bytes is None else dtype_bytes
        if not self.activation_bytes_per_token_hidden_layer:
            return stack_bytes(model, config.tp, d, sequence_parallel=self.sequence_parallel, recompute=recompute,
                               layers=layers)
        scale = d / self.activation_dtype_bytes
        full = (model.hidden / config.tp) * self.activation_factor(config.tp) * scale
        if recompute == MemoryPolicy.FULL:  # each layer's input (full hidden), plus the one recomputed
            return layers * model.hidden * RECOMPUTE_INPUT_BYTES * scale + full
        share = kept_share(model, config.tp, d, self.sequence_parallel, recompute)  # this runtime's, of a layer
        return layers * full * share + full * (recompute == MemoryPolicy.SELECTIVE)

    def activation_bytes(self, config: ParallelConfig, model: ModelSpec, tokens: int, recompute: int = 0,
                         held: int | None = None, dtype_bytes: int | None = None) -> float:
        """Activation bytes on the fullest rank for `held` micro-batches of `tokens` (CP: its share plus K/V)."""
        rank_tokens = max_rank_tokens(tokens, config.cp)
        per_token = self.bytes_per_token(config, model, recompute, held, dtype_bytes)
        return float(rank_tokens) * per_token + tokens * kv_buffer_bytes(model, config, recompute, held)

    def stage_activation_bytes(
        self, config: ParallelConfig, model: ModelSpec, stage: int, tokens: int, dtype_bytes: int, recompute: int,
        micro_batches: int | None = None, window: int | None = None, chunks: int | None = None,
    ) -> float:
        """What micro-batches of at most `tokens` keep for backward on a stage's fullest rank in the compute dtype:
        the layers' activations of those in flight (`in_flight`; all pp of them when the count is not given;
        `chunks` of them when given; `window`, the most tokens those in flight hold at once, when known, else
        count x `tokens`) and, on the last stage, the loss head's of the one in its loss (activations.head_bytes)."""
        count = chunks if chunks is not None else None if micro_batches is None else in_flight(
            config, stage, micro_batches)
        held = self.activation_bytes(config, model, tokens, recompute=recompute, held=count, dtype_bytes=dtype_bytes)
        if window is not None and count is not None and count > 1 and tokens and config.vp == 1:
            # The largest micro-batch whole, the others' tokens at the marginal micro-batch's bytes per token.
            one = self.activation_bytes(config, model, tokens, recompute=recompute, held=1, dtype_bytes=dtype_bytes)
            held = one + (held - one) * (min(window, count * tokens) - tokens) / ((count - 1) * tokens)
        if stage == config.pp - 1:
            share = max_rank_tokens(tokens, config.cp) if tokens else 0
            held += head_bytes(model, config.tp, dtype_bytes, share, sequence_parallel=self.sequence_parallel,
                               per_token=self.own_per_token)
        return held

    def block_bytes(self, config: ParallelConfig, model: ModelSpec, tokens: int, dtype_bytes: int,
                    recompute: int) -> float:
        """What one block keeps for backward of a micro-batch of `tokens` on its fullest rank: what each block
        whose backward has run frees (`reduce_wait`)."""
        per_block = self.activation_bytes(config, model, tokens, dtype_bytes=dtype_bytes) / model.layers
        return per_block * kept_share(model, config.tp, dtype_bytes, self.sequence_parallel, recompute)

    def loss_transient_bytes(self, config: ParallelConfig, model: ModelSpec, tokens: int, dtype_bytes: int) -> float:
        """The last stage's loss forward on top of what it keeps (activations.loss_transient_bytes)."""
        share = max_rank_tokens(tokens, config.cp) if tokens else 0
        return loss_transient_bytes(model, config.tp, dtype_bytes, share, self.own_per_token)

    @property
    def own_per_token(self) -> bool:
        """Whether this runtime's per-token terms beyond the layers count (the loss head's, a layer's backward):
        a published activation factor is its system's whole per-token memory and covers them."""
        return not self.activation_bytes_per_token_hidden_layer

    def cap(
        self, config: ParallelConfig, model: ModelSpec, num_gpus: int, recompute: int = 0,
        micro_batches: int | None = None, horizon: int = COUNT_HORIZON,
    ) -> int:
        """Most tokens (a multiple of 128) of a micro-batch whose every rank's peak fits beside the margin and context.

        A rank's peak is `rank_memory`'s, the runtime's own prediction, in the job's dtype (bf16 by default):
        its parameters, gradients and owned optimizer state, the activations of the micro-batches its
        stage holds in flight and (last stage) the loss head's, and beside them the loss's forward or the
        exchange's buffers (it overlaps compute). `micro_batches`: the replica's count; None, any count
        of at least two (stage s holds pp - s of them, `in_flight`; interleaved, each of `worst_counts`, the worst
        to `horizon`, as no count is every count's worst); 1, the replica's lone micro-batch
        (`lone_cap`: a deep replica holds it once, not pp times). The first and the last stage bind
        (embedding; head). 0 where not even the state and the exchange's buffers fit. Under CP a rank
        holds ceil(T/cp) + 2cp tokens of T plus the K/V attention keeps (`kv_buffer_bytes`), so the cap
        is about cp x the per-rank one, less those.
        """
        budget, bucket = self.usable_bytes, self.exchange_bucket_bytes
        caps = []
        counts = {s: worst_counts(config, s, horizon) if micro_batches is None else (micro_batches,)
                  for s in sorted({0, config.pp - 1})}
        for stage, count in ((s, c) for s, row in counts.items() for c in row):

            def rank(tokens: int, stage: int = stage, count: int = count) -> RankMemory:
                return rank_memory(self, model, config, stage=stage, num_gpus=num_gpus, tokens=tokens,
                                   micro_batches=count, dtype_bytes=self.compute_dtype_bytes, bucket_bytes=bucket,
                                   recompute=recompute)

            empty = rank(0)
            if empty.params + empty.owned + empty.after > budget:
                return 0  # not even the state and the exchange's buffers fit
            caps.append(_most_tokens(lambda t: rank(t).with_activations, budget - empty.params - empty.owned,
                                     CAP_GRANULARITY))
        return min(caps)

    def state_bytes(self, config: ParallelConfig, model: ModelSpec, num_gpus: int) -> float:
        """What the fullest stage of `config` holds before any activation: parameters, gradients, owned
        optimizer state and the exchange's buffers (the phase after backward), in the compute dtype."""
        bucket = self.exchange_bucket_bytes
        ranks = [
            rank_memory(self, model, config, stage=stage, num_gpus=num_gpus, tokens=0,
                        dtype_bytes=self.compute_dtype_bytes, bucket_bytes=bucket)
            for stage in sorted({0, config.pp - 1})
        ]
        return max(rank.params + rank.owned + rank.after for rank in ranks)

    @property
    def usable_bytes(self) -> float:
        """What a rank's tensors may hold: the memory less the safety margin and the runtime's context."""
        return self.memory_bytes - self.safety_margin_bytes - self.context_overhead_bytes


def _most_tokens(used: Callable[[int], float], free: float, step: int = 1) -> int:
    """The largest multiple T of `step` with used(T) <= free, for `used` nondecreasing and near affine in T (a
    `rank_memory`): guesses where lines meet `free`, each with its neighbour beyond (an exact guess closes the
    bracket), and halvings find it in a few evaluations (a bisection: about 35)."""
    at, lo, k = {0: used(0)}, 0, max(1, FIRST_PROBE // step)  # used(lo step) <= free < used(hi step)
    if at[0] > free:
        return 0
    for guess in itertools.count():  # the line from 0 through the last probe that fits (GUESSES times), then doubling
        at[k] = used(k * step)
        if at[k] > free:
            break
        lo, rise = k, at[k] - at[0]
        k = 2 * k if rise <= 0 or guess >= GUESSES else k + 1 + int((free - at[k]) * k / rise)
    hi = k
    while hi - lo > 1:
        g = min(max(lo + int((free - at[lo]) / (at[hi] - at[lo]) * (hi - lo)), lo + 1), hi - 1)
        for turn in range(3):  # the line through the bracket's ends, that guess's neighbour, a halving
            k = g if turn == 0 else (g + 1 if lo == g else g - 1) if turn == 1 else (lo + hi) // 2
            if lo < k < hi:
                at[k] = used(k * step)
                lo, hi = (k, hi) if at[k] <= free else (lo, k)
    return lo * step


@dataclass(frozen=True)
class RankMemory:
    """The bytes one rank holds at its peak, buffer by buffer (the runtime's, runtime/trainer.py).

    The compute shard's parameters and the owned fp32 master and moments are held throughout; the owned
    reduced gradient (`reduced`) from the reduce's first round to the step's end, or throughout in a later
    phase of a phased iteration (then it is in `owned`). The gradients (under bf16 scaled fp16 sums) are
    freed after every step, so backward allocates them afresh: with one micro-batch the activations are
    mostly freed by the time they are (the loss head's kept gradients cover the head's), and an idle
    replica has none; with more micro-batches the next forward's activations meet all of them. The last
    stage's loss forward holds its input and a chunk of logits on top for a moment (`loss_transient`);
    then each layer's backward holds its working set (`backward`). The exchange overlaps compute: the
    gather's buffers meet the first forward's layers, the reduce's (and the gradient it fills) the last
    backward, by when 1F1B holds one micro-batch (`reducing`), once the stage's last block freed its
    activations, unless one round moves everything (it then runs after the last layer). Interleaved, the
    gradients appear chunk by chunk and the reduce meets the chunks not yet through backward
    (activations.gradients_beside: `grads_with_activations`, `reduce_grads`, `reducing`). On the first stage
    the embedding's backward (the last of a micro-batch's) holds a dense gradient of its vocabulary shard
    beside every gradient sum, the chunks in flight and, once started, the reduce's buffers
    (`embedding_backward`, activations.embedding_backward). After the backward come the reduce's tail and
    the AdamW step's bucket-sized temporary.
    """

    params: float
    grads: float
    owned: float
    activations: float
    loss_transient: float
    backward: float
    grads_with_activations: float
    exchange_buffers: float  # the exchange's send and receive buffers (and a scaled gradient's fp32 round)
    exchange_buffers_with_activations: float
    step: float
    reduced: float  # the reduced gradient, from the reduce to the step (0: held throughout, in `owned`)
    reducing: float  # the activations beside the reduce: one micro-batch's (1F1B's last backward)
    reduce_after: int = 1  # the stage's last blocks backward frees before the reduce's first round (`reduce_wait`)
    reduce_grads: float | None = None  # interleaved: the gradients made by the reduce's start (None: as beside)
    embedding_backward: float = 0.0  # first stage: the embedding's backward beside every gradient (`_embedding`)

    @property
    def after(self) -> float:
        """What the phase after the backward adds to the parameters and owned state."""
        return self.grads + self.reduced + max(self.exchange_buffers, self.step)

    @property
    def with_activations(self) -> float:
        """What the activations' phase adds to the parameters and owned state: the activations, the gradients
        already allocated, and the loss's forward or, after it, a layer's backward and the exchange's buffers;
        on the first stage, or the embedding's backward beside every gradient."""
        return max(
            self.grads_with_activations + self.activations + max(self.loss_transient, self.backward),
            self.grads_beside_reduce + self.reducing + self.backward + self.exchange_buffers_with_activations,
            self.grads + self.embedding_backward if self.embedding_backward else 0.0,
        )

    @property
    def peak(self) -> float:
        return self.params + self.owned + max(self.with_activations, self.after)

    @property
    def before_reduce(self) -> float:
        """The reduce's phase without the reduce: state, gradients, one micro-batch and a layer's backward."""
        return self.params + self.owned + self.grads_beside_reduce + self.reducing + self.backward

    @property
    def grads_beside_reduce(self) -> float:
        """The gradients beside the reduce: those made by the time it starts (`reduce_grads`), else the ones
        beside the activations."""
        return self.grads_with_activations if self.reduce_grads is None else self.reduce_grads


def rank_memory(
    memory: MemoryModel, model: ModelSpec, config: ParallelConfig, stage: int, num_gpus: int, tokens: int,
    dtype_bytes: int, bucket_bytes: int, recompute: int = 0, micro_batches: int = 2, contributors: int | None = None,
    window: int | None = None,
) -> RankMemory:
    """A rank's memory for `micro_batches` micro-batches of at most `tokens` in the compute dtype's bytes;
    `contributors`: the gradients each owned element receives (a deployment's replicas, each CP rank
    apart; by default a homogeneous deployment of this config's); `window`: the most tokens the micro-batches
    its stage holds in flight at once have (a plan's; by default as many as in flight times `tokens`)."""
    shard = shard_params(model, config, stage)
    state = TrainingState.for_dtype(dtype_bytes)
    busy = micro_batches > 0
    grads = shard * state.grad_bytes if busy else 0.0  # an idle replica's reduce sends zeros
    owned = -(-model.num_params // num_gpus)
    reduced = owned * state.reduced_grad_bytes  # every owner receives, an idle replica's too
    held = owned * state.held_sharded_bytes + reduced * memory.reduced_held
    reduced *= not memory.reduced_held
    if contributors is None:
        contributors = max(1, num_gpus // config.num_gpus) * config.cp
    buffers, piece, one_round = _exchange(
        shard, owned, contributors=contributors, num_gpus=num_gpus, bucket_bytes=bucket_bytes, scaled=state.scaled
    )
    share = max_rank_tokens(tokens, config.cp)  # the fullest CP rank's tokens
    held_activations = memory.stage_activation_bytes(
        config, model, stage=stage, tokens=tokens, dtype_bytes=dtype_bytes, recompute=recompute,
        micro_batches=micro_batches, window=window,
    )
    start = reduce_start(model, config, micro_batches) if busy and not one_round else None
    reducing = memory.stage_activation_bytes(  # what the reduce meets: one micro-batch under 1F1B
        config, model, stage=stage, tokens=tokens, dtype_bytes=dtype_bytes, recompute=recompute, micro_batches=1,
        chunks=reduce_chunks(config, stage, micro_batches, start),
    )
    # The block recompute runs again exists beside its backward only, not the loss's forward.
    again = share * memory.own_per_token * recomputed_bytes(
        model, config.tp, dtype_bytes, sequence_parallel=memory.sequence_parallel, policy=recompute)
    one = float(np.diff([memory.activation_bytes(config, model, tokens, recompute, held=k, dtype_bytes=dtype_bytes)
                         for k in (1, 2)])[0])  # one more chunk in flight
    grads_beside, reduce_grads = gradients_beside(
        config, stage, micro_batches, grads=grads, reducing=reducing, one=one, start=start,
        sums=chunk_grads(model, config, stage, state.grad_bytes),
    )
    table = model.vocab_rows // config.tp * model.hidden * dtype_bytes * (busy and stage == 0)
    last = stage == config.pp - 1
    rank = RankMemory(
        params=shard * state.param_bytes,
        grads=grads,
        owned=held,
        activations=(held_activations - again) * busy,
        reducing=(reducing - again) * busy,
        loss_transient=memory.loss_transient_bytes(config, model, tokens, dtype_bytes) if busy and last else 0.0,
        backward=(share * backward_bytes(model, config.tp, dtype_bytes) + again) * (busy and memory.own_per_token),
        grads_with_activations=grads_beside,
        reduce_grads=reduce_grads,
        exchange_buffers=buffers,
        exchange_buffers_with_activations=0.0,
        step=piece * (1 + state.scaled),
        reduced=reduced,
        embedding_backward=embedding_backward(
            config, micro_batches, scaled=state.scaled, table=table, one=one, start=start, exchange=buffers + reduced
        ),
    )
    if one_round or not busy:
        return rank
    # Otherwise the gather's buffers meet the first forward's layers, the reduce's and the reduced gradient the last
    # backward's once the stage's last blocks freed theirs (`reduce_wait`); with one micro-batch, beside their grads.
    made = 0.0 if micro_batches > 1 else layer_shard_params(model, config.tp) * state.grad_bytes
    net = memory.block_bytes(config, model, tokens, dtype_bytes, recompute) - made
    after = reduce_wait(buffers + reduced, net, memory.usable_bytes - rank.before_reduce, model.layers // config.pp)
    beside = max(0.0, buffers + reduced - after * net)
    return replace(rank, reduce_after=after, exchange_buffers_with_activations=beside)


def _exchange(shard: int, owned: int, contributors: int, num_gpus: int, bucket_bytes: int,
              scaled: bool) -> tuple[float, float, bool]:
    """The exchange's buffers, the AdamW step's piece, and whether one round moves everything.

    A round sends the rank's pieces of its shard and receives every contributor's to its owned range
    (runtime/optimizer/exchange_plan.py). One round moves everything when an owner's range fits a window of half a
    bucket over every rank: one pair of buffers, whole; the gather completes before the first layer and the
    reduce starts after the last. Otherwise two rounds in flight, each buffer at most half a bucket. A scaled
    reduced gradient sums each round in fp32 before it keeps it; AdamW works in pieces of half a bucket: the
    denominator and, scaled, the gradient's fp32 values.
    """
    send, receive = EXCHANGE_ELEMENT_BYTES * shard, EXCHANGE_ELEMENT_BYTES * owned * contributors
    one_round = owned * EXCHANGE_ELEMENT_BYTES * 2 * num_gpus <= bucket_bytes
    buffers = send + receive if one_round else 2 * (min(bucket_bytes / 2, send) + min(bucket_bytes / 2, receive))
    piece = min(bucket_bytes / 2, EXCHANGE_ELEMENT_BYTES * owned)
    return buffers + piece * scaled, piece, one_round


def reduce_wait(need: float, net: float, free: float, blocks: int) -> int:
    """The stage's last blocks backward frees before the reduce's first round: one, unless the reduce's buffers
    and the reduced gradient (`need`) then exceed what is `free` beside the last backward's activations; then
    the fewest whose freed activations (`net` each, less the gradients they made) make room, at most all.

    The reduce's rounds go out later in backward, so less of them is hidden; only where memory binds (the caps
    of llama-32b with pp = 1, where the gradient's 2 GB exceed one block's activations)."""
    if net <= 0 or need - net <= free:
        return 1
    return int(min(blocks, max(1, np.ceil((need - free) / net))))
