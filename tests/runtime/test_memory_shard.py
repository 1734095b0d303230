"""The memory model's compute shard (numpy, from the shape) against the parameters the runtime builds.

`cost.memory.shard_params` never imports torch; here every rank's `StageModel` is built on the meta
device, as runtime/optimizer/layout.py does for its layout, and its elements are counted.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from hydraulis.cost.memory import shard_params
from hydraulis.families import spec_from_hf_config
from hydraulis.parallel import ParallelConfig
from hydraulis.runtime.modeling.model import StageModel
from hydraulis.runtime.parallelism.tensor_parallel import TensorParallel

QWEN2 = {  # a small Qwen2: q/k/v biases, GQA (4 heads, 2 KV heads), tied or not
    "model_type": "qwen2", "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 160,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
}  # fmt: skip


def runtime_shard(spec, config: ParallelConfig, stage: int, tp_rank: int) -> int:
    tp = TensorParallel.describing(config.tp, tp_rank, False)
    model = StageModel(spec, tp, stage, config.pp, device="meta")
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (2, 1), (1, 2), (2, 2), (4, 1)])
def test_shard_params_is_what_each_rank_builds(tied, padded, tp, pp):
    """A tied single stage holds the vocabulary matrix once; a tied model's last stage holds its own copy.
    tp4 exceeds the 2 KV heads: every rank keeps all of K and V (and their biases). A vocabulary of 997
    padded for tp 1, 2 and 4 is 1,000 rows of embedding and head."""
    spec = spec_from_hf_config({**QWEN2, "tie_word_embeddings": tied}, "qwen2-small")
    if padded:
        spec = replace(spec, vocab=997).padded_for([1, 2, 4])
        assert spec.vocab_rows == 1000
    assert spec.arch.tied_embeddings == tied and spec.arch.qkv_bias
    config = ParallelConfig(tp, pp)
    for stage in range(pp):
        built = {runtime_shard(spec, config, stage, r) for r in range(tp)}
        assert built == {shard_params(spec, config, stage)}, (config, stage)
    if tied and pp == 1:
        untied = replace(spec, arch=replace(spec.arch, tied_embeddings=False))
        assert shard_params(untied, config, 0) - shard_params(spec, config, 0) == spec.vocab_rows * spec.hidden // tp

