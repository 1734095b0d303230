"""The memory model's runtime terms: the exchange in caps, and a rank's peak buffer by buffer."""

from __future__ import annotations

import dataclasses

from hydraulis.cost import load_cost_model
from hydraulis.cost.memory import DEFAULT_EXCHANGE_BUCKET_BYTES, rank_memory, shard_params
from hydraulis.parallel import ParallelConfig
from hydraulis.specs import MODELS

GiB = 2**30


def test_caps_count_the_exchange_as_two_buckets_and_refuse_configs_it_does_not_fit():
    for profile, gpus in (("llama-13b@a800-80g", 32), ("llama-13b@a800-80g", 64), ("llama-7b@a800-80g", 16)):
        cost = load_cost_model(profile)
        caps = cost.caps(gpus)
        # The reduce once held every replica's copy of the owned range (156 GB for llama-13b as
        # 32x(tp1,pp1)); now each buffer is at most one bucket.
        assert cost.memory.exchange_buffer_bytes(cost.model) == 2 * DEFAULT_EXCHANGE_BUCKET_BYTES
        assert any(cap > 0 for cap in caps.values())
        for config, cap in caps.items():
            # The buffers live beside the activations (the exchange overlaps compute): free memory is net of them.
            free = cost.memory.free_bytes(config, cost.model, gpus)
            exchange = cost.memory.exchange_buffer_bytes(cost.model)
            without = dataclasses.replace(cost.memory, exchange_bytes=0).free_bytes(config, cost.model, gpus)
            assert without - free == exchange and (cap == 0 or free > 0), config
    # A config whose memory holds activations but not the exchange's buffers beside them gets no cap.
    cost = load_cost_model("llama-7b@a800-80g")
    config = ParallelConfig(1, 2)
    free = cost.memory.free_bytes(config, cost.model, 16) + cost.memory.exchange_buffer_bytes(cost.model)
    assert free < 8 * cost.model.num_params  # so the bucket, not the model's size, bounds the buffers
    tight = dataclasses.replace(cost.memory, exchange_bytes=free + 1)
    assert cost.memory.cap(config, cost.model, 16) > 0 and tight.cap(config, cost.model, 16) == 0


def test_rank_peak_counts_state_activations_and_one_phase_at_a_time():
    spec = MODELS["small"]
    config = ParallelConfig(1, 1)
    shard = shard_params(spec, config, 0)
    assert shard == spec.num_params  # tp1 pp1 holds the whole model
    bucket = 4 << 20
    one = rank_memory(load_cost_model("small@cpu").memory, spec, config, 0, 4, 512, 4, bucket, micro_batches=1)
    many = rank_memory(load_cost_model("small@cpu").memory, spec, config, 0, 4, 512, 4, bucket, micro_batches=3)
    assert one.params == 4 * shard and one.owned == 16 * -(-spec.num_params // 4)
    assert one.exchange == 2 * bucket and one.step == bucket
    # Logits (fp32, twice) of 512 tokens over a 50,304 vocabulary are on top of the layers' activations.
    assert one.activations > 2 * 4 * 512 * spec.vocab
    # With several micro-batches every gradient is alive during the next forward; with one only the head's.
    assert many.peak - one.peak == 4 * shard - 4 * spec.vocab * spec.hidden
    bf16 = rank_memory(load_cost_model("small@cpu").memory, spec, config, 0, 4, 512, 2, bucket, micro_batches=3)
    assert bf16.grads == 4 * shard and bf16.params == 2 * shard  # fp32 main gradients under bf16 compute
