"""What this runtime keeps for backward, counted from its structure (runtime/modeling/: model.py,
attention.py, cross_entropy.py).

Per token of a micro-batch, per layer, on one TP rank (d: the compute
dtype's bytes; q, kv, f: the rank's query, key and FFN columns):

- each RMSNorm (runtime/modeling/fused.py): its input and one fp32 rsqrt, and its
  output, which the following linears keep as their input. Under sequence
  parallelism the norm's own tensors hold 1/tp of the tokens, but the
  linears keep the all-gathered input whole;
- attention: q and k after RoPE, v, the output and its copy as o_proj's
  input (d x (3q + 2kv)), and the softmax's log-sum-exp (fp32 per head);
  RoPE's multiplications keep only cos and sin, shared by all layers;
- SwiGLU (fused.py): w1's and w3's outputs, and the product as w2's input
  (3 d f);
- Qwen3's q/k norms: their input and an fp32 rsqrt per head.

Under full recompute a block keeps only its input, and one block's whole
set exists while it is recomputed; under selective recompute (policies.py) the
MLP's input replaces its norm's tensors and SwiGLU's, and one MLP's set exists
while it is recomputed. A layer's backward holds its SwiGLU's
gradients and a temporary beside that (`backward_bytes`). The last stage adds the final norm and
the loss head (cross_entropy.py): the hidden states' gradient (compute
dtype, every token) and the head's gradient in fp32, both computed in
forward and kept to backward, and one chunk's logits in flight
(`loss_chunk_rows` rows: in the compute dtype and in fp32). `tests/cost/
test_activations.py` checks these counts against the tensors torch saves.
"""

from __future__ import annotations

import functools

from hydraulis.cost.policies import MemoryPolicy
from hydraulis.cost.shards import layer_shard_params, shard_params
from hydraulis.parallel import ParallelConfig
from hydraulis.pipeline_order import interleave_group, warmup_count
from hydraulis.specs import ModelSpec

KV_BYTES = 2  # K and V travel over the CP group in the compute dtype (bf16)
LIVE_KV_COPIES = 3  # document-sized K/V copies of the one layer in CP backward (kv_buffer_bytes)

LOSS_CHUNK_ELEMENTS = 1 << 24  # logits of one loss chunk (at least LOSS_CHUNK_MIN_ROWS rows): 96 MiB in bf16 and fp32
LOSS_CHUNK_MIN_ROWS = 256  # rows of one loss chunk at least, so that its GEMM stays efficient
WIDE_BYTES = 4  # fp32: norms' inputs, rsqrt, log-sum-exp, the loss's softmax and the head's gradient sum


def loss_chunk_rows(tokens: int, vocab_columns: int) -> int:
    """Rows per chunk of the loss head: LOSS_CHUNK_ELEMENTS logits, so that what a chunk holds does not grow with
    the micro-batch, but at least LOSS_CHUNK_MIN_ROWS rows and at most the micro-batch (at least 1)."""
    return max(1, min(tokens, max(LOSS_CHUNK_MIN_ROWS, LOSS_CHUNK_ELEMENTS // max(1, vocab_columns))))


def kv_shard_dim(model: ModelSpec, tp: int) -> int:
    """K (or V) columns one TP rank holds: its share of the KV heads, one whole head when tp > kv_heads."""
    return model.kv_heads * model.head_dim // min(tp, model.kv_heads)


def _norm_bytes(width: float, dtype_bytes: int) -> float:
    """One RMSNorm's own tensors per row (runtime/modeling/fused.py): its input and the fp32 rsqrt."""
    return dtype_bytes * width + WIDE_BYTES


def layer_bytes(model: ModelSpec, tp: int, dtype_bytes: int, sequence_parallel: bool = False) -> float:
    """Bytes one transformer block keeps for backward per token of the micro-batch, on one TP rank."""
    d, h = dtype_bytes, model.hidden
    sp = 1 / tp if sequence_parallel and tp > 1 else 1.0
    q, kv = model.heads * model.head_dim / tp, kv_shard_dim(model, tp)
    heads, kv_heads = model.heads / tp, kv / model.head_dim
    norms = 2 * (_norm_bytes(h, d) * sp + d * h)
    attention = d * (3 * q + 2 * kv) + WIDE_BYTES * heads
    ffn = 3 * d * model.ffn / tp
    qk_norm = _norm_bytes(q, d) + _norm_bytes(kv, d) + WIDE_BYTES * (heads + kv_heads - 2) if model.arch.qk_norm else 0
    return norms + attention + ffn + qk_norm


def mlp_bytes(model: ModelSpec, tp: int, dtype_bytes: int, sequence_parallel: bool = False) -> float:
    """Per token: what a block's MLP keeps without recompute, its norm's tensors, the norm's output as w1's and
    w3's input and SwiGLU's three projections; selective recompute keeps the MLP's input instead."""
    d, h = dtype_bytes, model.hidden
    sp = 1 / tp if sequence_parallel and tp > 1 else 1.0
    return _norm_bytes(h, d) * sp + d * h + 3 * d * model.ffn / tp


def kept_share(model: ModelSpec, tp: int, dtype_bytes: int, sequence_parallel: bool, policy: int) -> float:
    """The share of a block's activations (`layer_bytes`) it keeps under a memory policy (full: 0, its input
    aside, as the reduce's wait counts what a block frees)."""
    if policy == MemoryPolicy.FULL:
        return 0.0
    whole = layer_bytes(model, tp, dtype_bytes, sequence_parallel)
    if policy == MemoryPolicy.NONE:
        return 1.0
    sp = 1 / tp if sequence_parallel and tp > 1 else 1.0
    return (whole - mlp_bytes(model, tp, dtype_bytes, sequence_parallel) + dtype_bytes * model.hidden * sp) / whole


def backward_bytes(model: ModelSpec, tp: int, dtype_bytes: int) -> float:
    """Per token: what a layer's backward holds beyond what the layers keep, at its largest: SwiGLU's (fused.py),
    the incoming gradient and up's gradient, less w2's input, which w2's backward has freed by then, and silu's
    derivative in fp32 (the sigmoid and its complement: (d + 2 x 4) ffn / tp)."""
    return (dtype_bytes + 2 * WIDE_BYTES) * model.ffn / tp


def rope_bytes(model: ModelSpec, dtype_bytes: int) -> float:
    """cos and sin per token, kept once per micro-batch and shared by its layers."""
    return model.head_dim * dtype_bytes


def stack_bytes(
    model: ModelSpec, tp: int, dtype_bytes: int, sequence_parallel: bool = False, recompute: int = 0,
    layers: int | None = None,
) -> float:
    """Per token: what `layers` layers in flight keep (all L by default: 1F1B keeps pp micro-batches of L/pp
    layers on the first stage) under the memory policy `recompute` (policies.MemoryPolicy; a bool reads as
    none or full): under full recompute each one's input plus one block's whole set, under selective each
    one's share (`kept_share`) plus one MLP's set; and RoPE's tables."""
    one = layer_bytes(model, tp, dtype_bytes, sequence_parallel)
    count = model.layers if layers is None else layers
    again = recomputed_bytes(model, tp, dtype_bytes, sequence_parallel, recompute)
    if recompute == MemoryPolicy.FULL:
        sp = 1 / tp if sequence_parallel and tp > 1 else 1.0
        return count * model.hidden * dtype_bytes * sp + again + rope_bytes(model, dtype_bytes)
    kept = count * one * kept_share(model, tp, dtype_bytes, sequence_parallel, recompute)
    return kept + again + rope_bytes(model, dtype_bytes)


def recomputed_bytes(model: ModelSpec, tp: int, dtype_bytes: int, sequence_parallel: bool, policy: int) -> float:
    """Per token: what backward recomputes of one block at a time under a memory policy (full: the block's
    set, selective: its MLP's), beside that block's backward (memory.rank_memory), not the loss's forward."""
    if policy == MemoryPolicy.FULL:
        return layer_bytes(model, tp, dtype_bytes, sequence_parallel)
    return mlp_bytes(model, tp, dtype_bytes, sequence_parallel) if policy == MemoryPolicy.SELECTIVE else 0.0


def head_bytes(
    model: ModelSpec, tp: int, dtype_bytes: int, tokens: int, sequence_parallel: bool = False, per_token: bool = True
) -> float:
    """What the last stage keeps for a micro-batch of `tokens` beyond its layers, from its loss's forward to its
    backward: the final norm's tensors, the hidden states' gradient (every token) and the head's fp32 gradient
    sum. `per_token=False`: only what does not grow with the tokens (a published activation factor covers
    the rest)."""
    d, h = dtype_bytes, model.hidden
    sp = 1 / tp if sequence_parallel and tp > 1 else 1.0
    kept = tokens * (_norm_bytes(h, d) * sp + d * h) if per_token else 0.0
    return kept + WIDE_BYTES * model.vocab_rows // tp * h


def loss_transient_bytes(model: ModelSpec, tp: int, dtype_bytes: int, tokens: int, per_token: bool = True) -> float:
    """What the last stage's loss forward holds on top while it runs: its input (every token) and one chunk's
    logits in the compute dtype and fp32 or, in a 2-byte dtype, the chunk's gradient beside the head gradient's
    GEMM in the compute dtype (its conversion in backward is no larger)."""
    if tokens == 0:
        return 0.0
    d, h = dtype_bytes, model.hidden
    columns = model.vocab_rows // tp
    rows = loss_chunk_rows(tokens, columns)
    chunk = (d + WIDE_BYTES if d < WIDE_BYTES else WIDE_BYTES) * rows * columns
    in_flight = max(chunk, d * (rows + h) * columns if d < WIDE_BYTES else 0.0)
    return (tokens * d * h if per_token else 0.0) + in_flight


def kv_buffer_bytes(
    model: ModelSpec, config: ParallelConfig, recompute: int = 0, held: int | None = None
) -> float:
    """Bytes per token of a micro-batch that CP adds on a rank, beyond its share of the activations.

    Attention is blockwise (runtime/modeling/blockwise_attention.py): a chunk at [a, b) keeps for backward
    its own K/V (counted in the activations) and a copy of the gathered prefix 0..a-1. A rank's two
    zigzag chunks k and 2cp-1-k start at k/2cp and (2cp-1-k)/2cp of the document, so it keeps
    (1 - 1 / 2cp) x the document's K/V per layer, for every layer in flight (`held` micro-batches of
    L/pp layers under 1F1B, pp of them by default; one layer under full recompute, attention's all under
    selective). On top, while one layer runs backward: its gathered K/V's gradient, the gathered layout of
    it, and the reduce-scatter's reordered copy (3 x the document's K/V). Nothing is O(chunk x prefix): no
    mask, and the block kernels keep O(chunk) softmax statistics.
    """
    if config.cp == 1:
        return 0.0
    per_layer = 2 * kv_shard_dim(model, config.tp) * KV_BYTES
    in_flight_layers = held_layers(model, config, held)
    kept_layers = 1 if recompute == MemoryPolicy.FULL else in_flight_layers
    return kept_layers * per_layer * (1 - 1 / (2 * config.cp)) + LIVE_KV_COPIES * per_layer


def in_flight(config: ParallelConfig, stage: int, micro_batches: int) -> int:
    """Model chunks (each L / (pp vp) layers) whose activations a stage holds at once, under 1F1B min(pp - stage, M).

    Stage s warms up with min(pp - s - 1, M) forwards and then alternates one forward with one
    backward (runtime/pipeline/), so a lone micro-batch on a deep replica is held once, not pp times.
    Interleaved (vp > 1, planner/sim.py's `interleaved_order`), Megatron's warm-up: 2 (pp - s - 1) + (vp - 1) N
    chunk forwards before the first backward (N = `interleave_group`), then one more, at most all M vp.
    """
    return max(1, min(warmup(config, stage, micro_batches) + 1, micro_batches * config.vp))


def warmup(config: ParallelConfig, stage: int, micro_batches: int) -> int:
    """Chunk forwards a stage runs before its first backward (`in_flight`; pipeline_order.warmup_count)."""
    return warmup_count(config.pp, config.vp, micro_batches, stage)


def backward_index(config: ParallelConfig, micro_batches: int, micro_batch: int, chunk: int) -> int:
    """Where the backward of a micro-batch's chunk comes among its stage's M vp backwards: by groups of
    N micro-batches (`interleave_group`), each group's chunks from the last to the first (planner/sim.py's
    `interleaved_order`); under 1F1B the micro-batch's own index."""
    if config.vp == 1:
        return micro_batch
    group = interleave_group(config.pp, micro_batches)
    first = micro_batch // group * group
    size = min(group, micro_batches - first)
    return first * config.vp + (config.vp - 1 - chunk) * size + micro_batch - first


def held_after(config: ParallelConfig, stage: int, micro_batches: int, k: int, refill: bool = True) -> int:
    """Chunks a stage holds once its k-th backward freed its chunk: with `refill`, after the forward that
    follows it in the steady state (warm-up + 1, as many as `in_flight`), else before it (warm-up); fewer in
    the cool-down, where no forward follows."""
    held = warmup(config, stage, micro_batches) + refill
    return max(0, min(held, micro_batches * config.vp - k - 1))


def held_layers(model: ModelSpec, config: ParallelConfig, held: int | None) -> int:
    """Layers whose activations a stage keeps for `held` chunks in flight (None: the first stage's at its worst
    count, `worst_count`; under 1F1B pp chunks of L / pp layers, L in all)."""
    if held is None:
        held = in_flight(config, 0, worst_count(config, 0))
    return model.layers // (config.pp * config.vp) * held


COUNT_HORIZON = 1024  # the most micro-batches the cap for any count is for (`worst_counts`); beyond, each count's own


def worst_counts(config: ParallelConfig, stage: int, horizon: int = COUNT_HORIZON) -> tuple[int, ...]:
    """The micro-batch counts of at least two that make a stage hold the most at once: the counts a cap for any
    count is for (1F1B: pp + 1, more than in flight). Interleaved, Megatron's group N (`interleave_group`, the
    smallest from pp that leaves no last group under pp) follows no period: M = 1 mod lcm(pp, ..., K) needs
    N > K, and the warm-up grows with N (pp 8: N 15 at M = 133, 16 at 157, 20 at 631), so no count is every
    count's worst. Over the counts to `horizon` (at most COUNT_HORIZON), the one with the largest warm-up, and
    the one with the largest among those where a forward follows chunk 0's first backward, so that every
    gradient meets the chunks in flight (`gradients_beside`); `counted` holds every interleaved plan at its own
    count."""
    if config.vp == 1:
        return (config.pp + 1,)
    return _worst_interleaved(config.pp, config.vp, stage, count_horizon(config, horizon))


def count_horizon(config: ParallelConfig, most: int) -> int:
    """The horizon a cap for every count from 2 to `most` micro-batches is taken to (`worst_counts`): COUNT_HORIZON
    under 1F1B (no count past pp + 1 holds more) and from it on; interleaved, the count before the next one past
    `most` whose warm-up outgrows every smaller count's, on the stages a cap checks (first, last), so that a
    horizon covers at least `most` and the caps of the counts a decision may lead to are taken at few horizons
    (a batch of n sequences packs at most n micro-batches on a replica)."""
    most = max(2, min(most, COUNT_HORIZON))
    if config.vp == 1 or most == COUNT_HORIZON:
        return COUNT_HORIZON
    records = _records(config.pp, config.vp)
    return next((r - 1 for r in records if r > most), COUNT_HORIZON)


@functools.lru_cache(maxsize=64)
def _records(pp: int, vp: int) -> tuple[int, ...]:
    """The counts to COUNT_HORIZON whose warm-up outgrows every smaller count's (from two), on stage 0 or pp - 1,
    by whether a forward follows chunk 0's first backward (`_worst_interleaved`'s two groups), ascending."""
    config = ParallelConfig(1, pp, vp=vp)
    out: set[int] = set()
    for stage in sorted({0, pp - 1}):
        top = {False: 0, True: 0}
        for m in range(2, COUNT_HORIZON + 1):
            held, full = in_flight(config, stage, m), _forward_follows(config, stage, m)
            if held > top[full]:
                top[full] = held
                out.add(m)
    return tuple(sorted(out))


def _forward_follows(config: ParallelConfig, stage: int, micro_batches: int) -> bool:
    """Whether a forward follows chunk 0's first backward on `stage` (`worst_counts`)."""
    return backward_index(config, micro_batches, 0, 0) < micro_batches * config.vp - warmup(
        config, stage, micro_batches) - 1


@functools.lru_cache(maxsize=256)
def _worst_interleaved(pp: int, vp: int, stage: int, horizon: int = COUNT_HORIZON) -> tuple[int, ...]:
    """`worst_counts` of an interleaved stage to `horizon`, which the TP and CP sizes do not move: one scan per pp,
    vp, stage, horizon."""
    config = ParallelConfig(1, pp, vp=vp)
    counts = range(2, horizon + 1)
    groups = ([m for m in counts if not _forward_follows(config, stage, m)],
              [m for m in counts if _forward_follows(config, stage, m)])
    worst = [max(group, key=lambda m: (in_flight(config, stage, m), m)) for group in groups if group]
    return tuple(sorted(set(worst)))


def counted(config: ParallelConfig, micro_batches: int) -> int | None:
    """The micro-batch count a cap is for: the count itself where it may hold other than the worst count's in
    flight (`memory.cap`'s None): 1F1B below pp (fewer), interleaved every count (its group, and the chunks in
    flight with it, grow past any finite worst: `worst_counts`); else None (1F1B from pp on, pp - s in flight)."""
    if micro_batches == 1 or config.vp > 1:
        return micro_batches
    return micro_batches if micro_batches < config.pp else None


def worst_count(config: ParallelConfig, stage: int) -> int:
    """The count of `worst_counts` that holds the most chunks at once."""
    return max(worst_counts(config, stage), key=lambda m: (in_flight(config, stage, m), m))


def chunk_grads(model: ModelSpec, config: ParallelConfig, stage: int, grad_bytes: int) -> list[float]:
    """Per model chunk, the bytes of the gradient sums its parameters make, from its first backward on: its
    layers' and, on the first stage chunk 0's, the embedding's, on the last the last chunk's, the head's."""
    layers = model.layers // (config.pp * config.vp) * layer_shard_params(model, config.tp) * grad_bytes
    sums = [float(layers)] * config.vp
    sums[0 if stage == 0 else -1] += shard_params(model, config, stage) * grad_bytes - config.vp * layers
    return sums


def gradients_beside(
    config: ParallelConfig, stage: int, micro_batches: int, *, grads: float, reducing: float, one: float,
    sums: list[float], start: int | None,
) -> tuple[float, float | None]:
    """The gradients beside the activations in flight, and those beside the reduce (None: the same); `reducing`:
    the activations the reduce meets, `one`: a chunk's, `sums`: each chunk's gradients (`chunk_grads`), `start`:
    the backward the reduce starts in (`reduce_start`; None: after the last).

    1F1B: the first backward makes every gradient: beside a full set in flight when a forward follows it (more
    micro-batches than in flight); with exactly as many, beside the others once the first one's are freed.
    Interleaved, backward runs the chunks from the last to the first, so chunk c's gradients (and the first
    stage's embedding's, chunk 0's) appear at its first backward, beside what the stage then holds
    (`held_after`): counted beside all in flight, each chunk freed by then (`one`) less. The reduce meets the
    chunks not yet through backward at its start (`reduce_chunks`) and the gradients made by then, or a later
    chunk's first backward's, each chunk freed since less. A lone micro-batch runs the stage's layers forward
    and then backward as under 1F1B, whatever the chunks."""
    if config.vp == 1 or micro_batches == 1:
        full = micro_batches * config.vp > in_flight(config, stage, micro_batches)
        return (grads if full else max(0.0, grads - reducing) * (micro_batches > 1)), None
    held = in_flight(config, stage, micro_batches)
    firsts = [backward_index(config, micro_batches, 0, c) for c in range(config.vp)]
    made = [sum(sums[c:]) for c in range(config.vp)]  # after chunk c's first backward: chunks c.. have theirs
    beside = max(made[c] - (held - held_after(config, stage, micro_batches, k)) * one for c, k in enumerate(firsts))
    start = micro_batches * config.vp - 1 if start is None else start
    chunks = reduce_chunks(config, stage, micro_batches, start)
    later = [made[c] - (chunks - held_after(config, stage, micro_batches, k, refill=False)) * one
             for c, k in enumerate(firsts) if k > start]
    at_start = made[min(c for c, k in enumerate(firsts) if k <= start)]
    return max(0.0, beside), max([at_start, *later])


def reduce_chunks(config: ParallelConfig, stage: int, micro_batches: int, start: int | None) -> int | None:
    """Chunks in flight when the reduce starts in backward `start` (`reduce_start`; None: after the last), the
    one in backward included; None under 1F1B or with one micro-batch (one micro-batch's: `in_flight`'s)."""
    if config.vp == 1 or micro_batches == 1:
        return None
    start = micro_batches * config.vp - 1 if start is None else start
    return held_after(config, stage, micro_batches, start, refill=False) + 1


def reduce_start(model: ModelSpec, config: ParallelConfig, micro_batches: int) -> int | None:
    """The backward (`backward_index`) in which the reduce's first round goes out: the last micro-batch's
    through the stage's blocks before its last (runtime/optimizer/exchange.py's `_tail`), its last chunk's
    unless that chunk is the one block; None where the stage has no block before it."""
    per_chunk = model.layers // (config.pp * config.vp)
    chunk = config.vp - 1 - (per_chunk < 2)
    return None if chunk < 0 else backward_index(config, micro_batches, micro_batches - 1, chunk)


def embedding_backward(
    config: ParallelConfig, micro_batches: int, *, scaled: bool, table: float, one: float, start: int | None,
    exchange: float,
) -> float:
    """What the first stage holds beside every gradient while the embedding's backward runs (the last of each
    micro-batch's, chunk 0's): the dense gradient of the whole vocabulary shard (`table`, in the compute dtype;
    0 on other stages) before it is added to the sum, beside the chunks then in flight (`one` each) and, once
    the reduce has started (`start`), its buffers and the reduced gradient (`exchange`). In fp32 the first
    micro-batch's gradient becomes the sum itself (autograd keeps it); scaled sums (main_grad.py) copy every
    one. 0 where no such backward runs."""
    if not table:
        return 0.0
    before, reducing = _embedding_chunks(config.pp, config.vp, micro_batches, 0 if scaled else 1, start)
    worst = [held * one for held in before] + ([] if reducing is None else [reducing * one + exchange])
    return table + max(worst) if worst else 0.0


@functools.lru_cache(maxsize=4096)
def _embedding_chunks(
    pp: int, vp: int, micro_batches: int, first: int, start: int | None
) -> tuple[tuple[int, ...], int | None]:
    """`embedding_backward`'s chunks in flight, which the tokens do not move: each count of them beside an embedding
    backward (micro-batches `first` on) before the reduce starts (`start`), and beside the first after it (later
    ones hold fewer; None where none is). Once per shape and count: a cap's search asks at many token counts."""
    config = ParallelConfig(1, pp, vp=vp)
    before: set[int] = set()
    for j in range(first, micro_batches):
        k = backward_index(config, micro_batches, j, 0)
        held = held_after(config, 0, micro_batches, k, refill=False)
        if start is not None and k >= start:
            return tuple(sorted(before)), held
        before.add(held)
    return tuple(sorted(before)), None
