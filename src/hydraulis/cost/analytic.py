"""Cost model from FLOPs and bytes, for any model shape and device preset.

Per layer and token, forward: 2 x (parameters per layer) GEMM FLOPs; causal
attention adds 2*s*h per token (so a*s^2 per sequence). Training is 3x forward,
4x with full recompute. TP adds 4*2*(tp-1)/tp*S*h elements of collectives per
layer and micro-batch (forward plus backward). Context parallelism (cp > 1)
splits each sequence's tokens over cp GPUs, so a and b both divide by cp, and
the K/V all-gather over the CP group adds to b and c (model.kv_gather). The default efficiencies are
calibrated against the published LLaMA-7B A800 profile, so analytic and
profiled times agree to within about 15 to 30 percent; the training state and
the activations are the runtime's own (`TrainingState`, activations.py).
"""

from __future__ import annotations

import math

from hydraulis.cost.context_parallel import kv_gather
from hydraulis.cost.memory import MemoryModel
from hydraulis.cost.model import Coefficients, CostModel
from hydraulis.cost.shards import TrainingState
from hydraulis.parallel import ParallelConfig
from hydraulis.specs import DeviceSpec, GiB, ModelSpec

MAX_TP = 16
MAX_PP = 16


def candidate_configs(model: ModelSpec, max_gpus: int = 1024) -> list[ParallelConfig]:
    """Power-of-two TP that divides the heads, PP that divides the layers (up to MAX_PP).

    CP configs are opt-in (`MODEL@DEVICE+cp`, model.extend_to_cp): the runtime must support them.
    """
    configs = []
    tp = 1
    while tp <= MAX_TP:
        if model.heads % tp == 0 and (model.kv_heads % tp == 0 or tp % model.kv_heads == 0):
            for pp in range(1, MAX_PP + 1):
                if model.layers % pp == 0 and (pp & (pp - 1) == 0 or pp in (3, 6)) and tp * pp <= max_gpus:
                    configs.append(ParallelConfig(tp, pp))
        tp *= 2
    return configs


class AnalyticCostModel(CostModel):
    def __init__(
        self,
        model: ModelSpec,
        device: DeviceSpec,
        gemm_efficiency: float = 0.65,
        attention_efficiency: float = 0.9,
        recompute: bool = False,
        layer_overhead_s: float = 0.9e-3,
        configs: list[ParallelConfig] | None = None,
    ) -> None:
        self.gemm_efficiency = gemm_efficiency
        self.attention_efficiency = attention_efficiency
        train = 3.0
        H, L, V = model.hidden, model.layers, model.vocab_rows  # the head computes the padded rows too
        coefficients = {}
        for config in configs or candidate_configs(model):
            tp, pp = config.tp, config.pp
            layers = L / pp
            tp_bw = device.intra_node_bw if tp <= device.gpus_per_node else device.inter_node_bw
            # Split over TP, each GPU's attention kernels see fewer heads and lose about a third
            # of their efficiency (published A800 profile: a is 1.5x the ideal for every tp > 1).
            attn_eff = attention_efficiency / (1.5 if tp > 1 else 1.0)
            attn = layers * 2 * H * train / (tp * config.cp * device.peak_flops * attn_eff)
            gemm = layers * 2 * model.params_per_layer * train / (tp * device.peak_flops * gemm_efficiency)
            head = 2 * H * V * train / (tp * pp * device.peak_flops * gemm_efficiency)
            comm = layers * 4 * 2 * (tp - 1) / tp * H * 2 / tp_bw if tp > 1 else 0.0
            overhead = layers * layer_overhead_s * (1 + 0.5 * math.log2(tp))
            # Context parallelism splits each sequence's tokens over cp GPUs: the per-token work
            # (GEMMs, head, TP collectives) divides by cp as the attention does; K/V cross the CP group.
            kv_b, kv_c = kv_gather(model, device, config)
            coefficients[config] = Coefficients(attn, (gemm + head + comm) / config.cp + kv_b, overhead + kv_c)
        # The runtime's training state (bf16 compute shard and its gradient sum; fp32 master, moments and
        # reduced gradient sharded over all GPUs) and its own activations: exactly what `rank_memory` counts.
        held = TrainingState()
        state = held.total_bytes * model.params_per_layer / (H * H)
        memory = MemoryModel(
            memory_bytes=device.memory_bytes,
            activation_bytes_per_token_hidden_layer={},
            state_bytes_per_hidden2_layer=state,
            optimizer_sharded_fraction=held.sharded_fraction,
            context_overhead_bytes=5 * 1000 * 2**20,
            safety_margin_bytes=max(6 * GiB, 0.075 * device.memory_bytes),
            embedding_state_bytes=held.total_bytes,
        )
        min_eff = {tp: 256 * (1 + int(math.log2(tp))) for tp in (1, 2, 4, 8, 16)}
        super().__init__(
            f"{model.name}@{device.name}", model, device,
            coefficients=coefficients, memory=memory, min_efficient_tokens=min_eff,
        )
        if recompute:
            recomputed = self.with_recompute(self.configs)
            self.a = recomputed.a
            self.b = recomputed.b
            self.recompute = recomputed.recompute
