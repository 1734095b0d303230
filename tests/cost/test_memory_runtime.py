"""The memory model's runtime terms: the exchange in caps, and a rank's peak buffer by buffer."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from hydraulis.cost import AnalyticCostModel, load_cost_model
from hydraulis.cost.memory import DEFAULT_EXCHANGE_BUCKET_BYTES, rank_memory, shard_params
from hydraulis.cost.shards import layer_shard_params
from hydraulis.parallel import ParallelConfig
from hydraulis.specs import MODELS, get_device, get_model

GiB = 2**30


PRESETS = ("llama-7b@a800-80g", "llama-13b@a800-80g", "llama-32b@a800-80g", "llama-7b@a800-80g+cp",
           "llama-13b@h100-80g", "llama-70b@h100-80g+cp", "small@cpu")


def budget(memory) -> float:
    return memory.memory_bytes - memory.safety_margin_bytes - memory.context_overhead_bytes


@pytest.mark.parametrize("profile", PRESETS)
@pytest.mark.parametrize("recompute", [False, True])
def test_every_caps_micro_batch_fits_the_runtimes_own_prediction(profile, recompute):
    """A cap the planner offers holds on every stage by the runtime's prediction of its peak (bf16: fp32 main
    gradients, the last stage's fp32 logits, the exchange's buffers), whatever the micro-batch count.
    The caps once left llama-32b as tp4pp1 on 16 GPUs at 85 GiB of an 80 GiB A800."""
    cost = load_cost_model(profile)
    if recompute:
        cost = cost.with_recompute(cost.configs)
    mem, offered = cost.memory, 0
    for gpus in (16, 32, 64):
        for config, cap in cost.caps(gpus).items():
            if cap == 0:
                continue
            offered += 1
            for stage, micro_batches in itertools.product(range(config.pp), (1, 2, 8)):
                rank = rank_memory(mem, cost.model, config, stage, gpus, cap, 2, DEFAULT_EXCHANGE_BUCKET_BYTES,
                                   recompute, micro_batches)
                assert rank.peak <= budget(mem), (gpus, config, stage, cap)
    assert offered > 0


def test_caps_count_the_exchange_and_refuse_configs_it_does_not_fit():
    for profile, gpus in (("llama-13b@a800-80g", 32), ("llama-13b@a800-80g", 64), ("llama-7b@a800-80g", 16)):
        cost = load_cost_model(profile)
        # The reduce once held every replica's copy of the owned range (156 GB for llama-13b as
        # 32x(tp1,pp1)); now each buffer is at most one bucket.
        assert cost.memory.exchange_buffer_bytes(cost.model) == 2 * DEFAULT_EXCHANGE_BUCKET_BYTES
        assert any(cap > 0 for cap in cost.caps(gpus).values())
    # A config whose free memory holds activations but not the exchange's buffers gets no cap.
    cost = load_cost_model("llama-13b@a800-80g")
    config = ParallelConfig(1, 2)
    rank = rank_memory(cost.memory, cost.model, config, 1, 16, 0, 2, DEFAULT_EXCHANGE_BUCKET_BYTES)
    left = budget(cost.memory) - rank.params - rank.owned - rank.grads
    assert 2 * DEFAULT_EXCHANGE_BUCKET_BYTES < left < 8 * shard_params(cost.model, config, 1)  # the bucket bounds them
    tight = dataclasses.replace(cost.memory, exchange_bytes=left + 2)
    assert cost.memory.cap(config, cost.model, 16) > 0 and tight.cap(config, cost.model, 16) == 0


def test_rank_peak_counts_state_activations_and_one_phase_at_a_time():
    spec = MODELS["small"]
    config = ParallelConfig(1, 1)
    shard = shard_params(spec, config, 0)
    assert shard == spec.num_params  # tp1 pp1 holds the whole model
    bucket = 4 << 20
    mem = load_cost_model("small@cpu").memory
    one = rank_memory(mem, spec, config, 0, 4, 512, 4, bucket, micro_batches=1)
    many = rank_memory(mem, spec, config, 0, 4, 512, 4, bucket, micro_batches=3)
    idle = rank_memory(mem, spec, config, 0, 4, 512, 4, bucket, micro_batches=0)
    owned = -(-spec.num_params // 4)
    # fp32 master and moments held throughout; the fp32 reduced gradient only from the reduce to the step.
    assert one.params == 4 * shard and one.owned == 12 * owned and one.reduced == 4 * owned
    # The model is many windows of 4 MiB buckets: two rounds in flight, a send and a receive buffer of
    # half a bucket each; AdamW works in pieces of half a bucket (in fp32 its denominator the only temporary).
    assert one.exchange_buffers == 2 * bucket and one.step == bucket // 2
    # The loss head keeps the head's fp32 gradient sum (50,304 x 256 x 4 bytes) whatever the tokens; its
    # chunked logits are a moment's, beside it and never more than 2^24 of them (in fp32: 64 MiB), though
    # 512 tokens of whole logits would have been 98 MiB.
    assert one.activations > 4 * spec.vocab * spec.hidden
    assert one.loss_transient <= 4 * 2**24 + 4 * 512 * spec.hidden < 4 * 512 * spec.vocab
    # With several micro-batches every gradient is alive during the next forward; with one, none (the head's
    # is in the loss head's keep); an idle replica has only its state and the exchange.
    assert many.peak - one.peak == 4 * shard
    assert idle.peak == idle.params + idle.owned + idle.reduced + idle.exchange_buffers
    bf16 = rank_memory(mem, spec, config, 0, 4, 512, 2, bucket, micro_batches=3)
    assert bf16.grads == 2 * shard and bf16.params == 2 * shard  # 2-byte gradient sums under bf16 compute


@pytest.mark.parametrize("pp", [1, 2])
def test_a_tied_head_is_counted_once_on_a_single_stage(pp):
    """Tied, a single stage holds the vocabulary matrix once; with stages the last holds its own copy. The
    optimizer owns one table either way (bf16: 2 + 2 bytes per held element, 14 per owned one)."""
    untied = get_model("llama-7b")
    tied = dataclasses.replace(untied, arch=dataclasses.replace(untied.arch, tied_embeddings=True))
    cost = AnalyticCostModel(untied, get_device("a800-80g"))
    mem, config, gpus, matrix = cost.memory, ParallelConfig(2, pp), 16, untied.vocab * untied.hidden
    held = matrix // 2 if pp == 1 else 0  # the head's tp2 shard a tied single stage does not hold
    last = pp - 1
    one = rank_memory(mem, tied, config, last, gpus, 1024, 2, DEFAULT_EXCHANGE_BUCKET_BYTES)
    two = rank_memory(mem, untied, config, last, gpus, 1024, 2, DEFAULT_EXCHANGE_BUCKET_BYTES)
    assert (two.params - one.params, two.grads - one.grads) == (2 * held, 2 * held)
    assert two.owned - one.owned == pytest.approx(12 * matrix / gpus, abs=12)
    assert two.reduced - one.reduced == pytest.approx(2 * matrix / gpus, abs=2)
    # One stage: the head's shard is gone, the peak shrinks. Two: the first stage (the embedding either way) may bind.
    assert one.peak < two.peak or pp > 1
    assert mem.cap(config, tied, gpus) >= mem.cap(config, untied, gpus)


def test_the_padded_vocabulary_is_what_the_models_count():
    """llama-7b's 32,000 tokens padded for tp 3 and 128 are 32,256 rows: the head computes them and holds them,
    and its fp32 gradient sum has a row for each, though the padded ones are masked."""
    spec = get_model("llama-7b")
    padded = spec.padded_for([3, 128])
    extra, config, device = padded.vocab_rows - spec.vocab, ParallelConfig(2, 2), get_device("a800-80g")
    assert extra == 256
    plain, wide = AnalyticCostModel(spec, device), AnalyticCostModel(padded, device)
    for stage in (0, 1):
        assert shard_params(padded, config, stage) - shard_params(spec, config, stage) == extra * spec.hidden // 2
    bucket = DEFAULT_EXCHANGE_BUCKET_BYTES
    rank = {s: rank_memory(plain.memory, s, config, 1, 16, 4096, 2, bucket) for s in (spec, padded)}
    assert rank[padded].activations - rank[spec].activations == 4 * spec.hidden * extra / 2
    head_s = 3 * 2 * spec.hidden * extra / (2 * 2 * device.peak_flops * wide.gemm_efficiency)  # fwd+bwd, tp2 pp2
    assert wide.coefficients(config).b - plain.coefficients(config).b == pytest.approx(head_s)


@pytest.mark.parametrize("pp", [2, 4])
def test_a_lone_micro_batch_is_held_once_per_stage(pp):
    """1F1B: stage s warms up with min(pp - s - 1, M) forwards, so it holds min(pp - s, M) micro-batches of
    L/pp layers. Stage 0 of llama-7b tp2 holds 32/pp layers x H/2 x A_2 bytes per token for each: pp of them
    with 8 micro-batches, one with a lone micro-batch; the last stage holds one either way."""
    cost = load_cost_model("llama-7b@a800-80g")
    mem, spec, config, bucket = cost.memory, cost.model, ParallelConfig(2, pp), DEFAULT_EXCHANGE_BUCKET_BYTES
    per_micro_batch = 4096 * (32 // pp) * spec.hidden / 2 * mem.activation_factor(2)
    for stage, micro_batches in itertools.product(range(pp), (1, 2, 8)):
        rank = rank_memory(mem, spec, config, stage, 16, 4096, 2, bucket, micro_batches=micro_batches)
        head = 4 * spec.vocab_rows / 2 * spec.hidden if stage == pp - 1 else 0  # the head's fp32 gradient sum
        assert rank.activations == pytest.approx(min(pp - stage, micro_batches) * per_micro_batch + head)
    # So a lone micro-batch holds more tokens than each of several: the lone cap, by the same prediction.
    cap, lone = cost.cap(config, 16), cost.lone_cap(config, 16)
    assert lone > 1.5 * cap
    for tokens, fits in ((lone, True), (lone + 128, False)):
        peaks = [rank_memory(mem, spec, config, s, 16, tokens, 2, bucket, micro_batches=1).peak for s in range(pp)]
        assert (max(peaks) <= budget(mem)) == fits
    many = [rank_memory(mem, spec, config, s, 16, lone, 2, bucket, micro_batches=2).peak for s in range(pp)]
    assert max(many) > budget(mem)  # two micro-batches of the lone cap do not fit


def test_a_budget_replaces_the_devices_memory_and_the_caps_follow_the_compute_dtype():
    """[parallel] memory_per_rank: what a rank's tensors may hold (no context, the margin's share of it). A
    measured profile's activation factors are in its own dtype: its fp32 caps are its bf16 ones halved, about."""
    cost = load_cost_model("tiny@cpu-measured")
    assert cost.memory.activation_dtype_bytes == 4  # measured in fp32 on CPU
    budget_bytes = 40 << 20
    job = cost.for_job(budget_bytes, 4)
    mem = job.memory
    assert mem.memory_bytes == budget_bytes and mem.context_overhead_bytes == 0
    assert mem.safety_margin_bytes == pytest.approx(0.1 * budget_bytes)  # the profile's 10% of its memory
    config = ParallelConfig(1, 1)
    cap = job.cap(config, 4)
    assert 0 < cap < job.lone_cap(ParallelConfig(1, 2), 4)
    fp32 = rank_memory(mem, cost.model, config, 0, 4, cap, 4, DEFAULT_EXCHANGE_BUCKET_BYTES, micro_batches=2)
    assert fp32.peak <= budget(mem)
    bf16 = cost.for_job(budget_bytes, 2)
    assert bf16.cap(config, 4) > 1.5 * cap
    assert cost.for_job(None, 4).memory.memory_bytes == cost.memory.memory_bytes


def published_cap(cost, config, gpus: int) -> int:
    """shared/DESIGN.md section 5's formula with the profile's own state and activation factors."""
    m, spec = cost.memory, cost.model
    L, H, V = spec.layers, spec.hidden, spec.vocab
    B, alpha, e = m.state_bytes_per_hidden2_layer, m.optimizer_sharded_fraction, 32 if config.pp == 1 else 16
    static = ((L / config.pp) * (H * H / config.tp) * B * (1 - alpha) + L * H * H * B * alpha / gpus
              + (H * V / config.tp) * e * (1 - alpha) + H * V * 32 * alpha / gpus)
    per_token = L * (H / config.tp) * m.activation_factor(config.tp)
    return int((budget(m) - static) / per_token) // 128 * 128


@pytest.mark.parametrize("profile", ["llama-7b@a800-80g", "llama-13b@a800-80g"])
def test_caps_hold_the_published_caps_and_a_later_phase_holds_the_reduced_gradient(profile):
    """bf16 on 32 GPUs: every config's cap is at least the published one (tp16pp1 137,984 tokens for llama-7b),
    because the 2-byte reduced gradient exists only from the reduce on and takes what the last block freed
    (with it held throughout, 7b tp16pp1 capped at 137,472). A later phase of a phased iteration holds it beside
    its activations: its caps are smaller, by at most the gradient's bytes' worth of tokens."""
    cost, gpus = load_cost_model(profile), 32
    later, smaller = cost.later_phase(), 0
    for config, cap in cost.caps(gpus).items():
        assert cap >= published_cap(cost, config, gpus), config
        # The reduce meets one micro-batch in flight (1F1B's last backward), not the first stage's pp.
        first = rank_memory(cost.memory, cost.model, config, 0, gpus, cap, 2, DEFAULT_EXCHANGE_BUCKET_BYTES,
                            micro_batches=8)
        assert config.pp == 1 or first.reducing == cost.memory.activation_bytes(config, cost.model, cap, held=1)
        reduced = rank_memory(cost.memory, cost.model, config, 0, gpus, 0, 2, DEFAULT_EXCHANGE_BUCKET_BYTES).reduced
        per_token = cost.memory.bytes_per_token(config, cost.model)
        # (Where the cap is small the reduce's buffers meet nearly all activations: the gradient is beside them.)
        assert cap - reduced / per_token - 2 * 128 <= later.cap(config, gpus) <= cap, config
        smaller += later.cap(config, gpus) < cap
        held = rank_memory(later.memory, cost.model, config, 0, gpus, 0, 2, DEFAULT_EXCHANGE_BUCKET_BYTES)
        assert held.reduced == 0 and held.owned == pytest.approx(7 * reduced, rel=1e-6)  # 12 + 2 bytes held
    assert smaller >= 10


@pytest.mark.parametrize("gpus", [16, 32, 64])
def test_llama_32b_holds_the_published_caps_the_reduce_waiting_where_its_buffers_need_room(gpus):
    """Every llama-32b config holds at least the published cap (tp8pp1 on 32 GPUs 19,328 against 18,816). With
    pp = 1 the reduce's buffers and the 2-byte reduced gradient (2.5 GB on 32 GPUs) exceed what one block frees
    (0.6 GB), so the reduce waits until a few of the stage's last blocks are through backward (`reduce_after`):
    each frees its activations less the gradients it made, and the fewest that make room count."""
    cost = load_cost_model("llama-32b@a800-80g")
    mem, spec, bucket = cost.memory, cost.model, DEFAULT_EXCHANGE_BUCKET_BYTES
    caps = {c: cap for c, cap in cost.caps(gpus).items() if cap}
    assert all(cap >= published_cap(cost, c, gpus) for c, cap in caps.items()), gpus
    waited = 0
    for config, cap in caps.items():
        for micro_batches in (1, 2):
            rank = rank_memory(mem, spec, config, 0, gpus, cap, 2, bucket, micro_batches=micro_batches)
            assert rank.peak <= budget(mem)
            if rank.reduce_after == 1:
                continue
            waited += 1
            # Not one block fewer: the reduce's phase would not fit (what the wait is for).
            need = rank.exchange_buffers + rank.reduced
            block = mem.activation_bytes(config, spec, cap, held=1) / spec.layers
            made = 0 if micro_batches > 1 else 2 * layer_shard_params(spec, config.tp)  # bf16 gradient sums
            fewer = rank.before_reduce + need - (rank.reduce_after - 1) * (block - made)
            assert fewer > budget(mem), (config, rank.reduce_after)
    assert waited >= (2 if gpus < 64 else 1)
    assert all(rank_memory(mem, spec, c, 0, gpus, cap, 2, bucket).reduce_after > 1 for c, cap in caps.items()
               if c.pp == 1 and gpus == 32)


def test_a_plans_micro_batches_in_flight_are_counted_as_they_are():
    """The runtime's prediction counts the tokens its stage holds in flight at once (`window`: a plan's
    consecutive micro-batches under 1F1B), not count x the largest, which the caps keep. The gradients meet a
    full set in flight only when a forward follows the first backward (more micro-batches than in flight);
    with exactly as many, only the other micro-batches' activations once the first one's are freed."""
    cost = load_cost_model("small@cpu")
    mem, spec, config, bucket = cost.memory, cost.model, ParallelConfig(1, 2), 4 << 20
    worst = rank_memory(mem, spec, config, 0, 4, 400, 4, bucket, micro_batches=2)
    assert rank_memory(mem, spec, config, 0, 4, 400, 4, bucket, micro_batches=2, window=800) == worst
    small = rank_memory(mem, spec, config, 0, 4, 400, 4, bucket, micro_batches=2, window=500)
    one = mem.activation_bytes(config, spec, 400, held=1, dtype_bytes=4)
    # 400 and 100 tokens: the largest whole, the other at the marginal micro-batch's bytes per token.
    assert small.activations == pytest.approx(one + (worst.activations - one) / 4)
    assert worst.activations == pytest.approx(2 * one, rel=1e-3)
    assert small.activations == pytest.approx(1.25 * one, rel=1e-3)
    assert worst.grads_with_activations == max(0.0, worst.grads - worst.reducing)
    more = rank_memory(mem, spec, config, 0, 4, 400, 4, bucket, micro_batches=3)
    assert more.grads_with_activations == more.grads and more.activations == worst.activations
    # The caps take the worst: more micro-batches than in flight, each of the cap.
    cap = cost.cap(config, 4)
    peaks = [rank_memory(mem, spec, config, 0, 4, cap + 128, 4, bucket, micro_batches=m).peak for m in (2, 3)]
    assert peaks[1] > budget(mem) and peaks[1] >= peaks[0]
