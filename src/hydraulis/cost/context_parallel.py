"""Context parallelism in the cost model: the K/V all-gather, the CP configs, the analytic extension.

Context parallelism (cp > 1) splits every sequence of a micro-batch over cp
GPUs: a and b divide by cp, and the K/V all-gather over the CP group (an
all-gather per layer forward, a reduce-scatter of dK/dV backward) adds to b
and c (`kv_gather`). `extend_to_cp` derives cp > 1 entries from measured
cp = 1 ones (an analytic extension, labelled `+cp`): attention is blockwise
(a chunk's causal diagonal plus its full prefix, no masked-out work), so
under the zigzag its FLOPs divide by cp like the GEMMs'. The K/V buffers a CP
rank keeps are memory (activations.kv_buffer_bytes).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from hydraulis.cost.activations import KV_BYTES, kv_shard_dim
from hydraulis.cost.model import Coefficients, CostModel
from hydraulis.cost.policies import RECOMPUTE_TIME
from hydraulis.limits import MAX_GPUS
from hydraulis.parallel import ParallelConfig
from hydraulis.specs import DeviceSpec, ModelSpec

# CP degrees the cost models offer: every power of two up to the data-parallel width of the largest jobs
# (a job's caps keep those that fit it, `CostModel.caps`), beside any PP: a replica's lone micro-batch is in
# flight once, so deep pipelines lower the memory a long sequence needs (Llama 3's 128K stage: tp8 cp16 pp16).
CP_DEGREES = tuple(2**k for k in range(1, 11))
CP_SUFFIX = "+cp"


def kv_gather_bytes(model: ModelSpec, config: ParallelConfig) -> float:
    """Bytes one rank moves per token of a micro-batch, one stage, forward plus backward, for CP.

    Forward all-gathers each layer's K and V over the CP group (a rank receives the (cp - 1) / cp it
    lacks of its TP shard); backward reduce-scatters dK and dV, the same bytes again.
    """
    if config.cp == 1:
        return 0.0
    layers = model.layers / config.pp
    return 2 * 2 * layers * kv_shard_dim(model, config.tp) * KV_BYTES * (config.cp - 1) / config.cp


def kv_gather(model: ModelSpec, device: DeviceSpec, config: ParallelConfig) -> tuple[float, float]:
    """(b, c) seconds the K/V all-gather adds per token and per micro-batch: NVLink inside a node, the NIC
    when the CP group spans nodes; a ring of cp - 1 steps pays cp - 1 latencies per collective."""
    if config.cp == 1:
        return 0.0, 0.0
    spans = config.cp_spans_nodes(device.gpus_per_node)
    bandwidth = device.inter_node_bw if spans else device.intra_node_bw
    collectives = 2 * model.layers / config.pp
    return kv_gather_bytes(model, config) / bandwidth, collectives * (config.cp - 1) * device.p2p_latency_s


def cp_configs(base: Sequence[ParallelConfig], max_gpus: int = MAX_GPUS) -> list[ParallelConfig]:
    """The CP configs built on cp = 1 ones: each CP_DEGREES degree on each base, within `max_gpus`."""
    return [
        ParallelConfig(g.tp, g.pp, cp)
        for g in base
        if g.cp == 1
        for cp in CP_DEGREES
        if g.num_gpus * cp <= max_gpus
    ]


def extend_to_cp(
    cost: CostModel, degrees: Sequence[int] = CP_DEGREES, only: Callable[[ParallelConfig], bool] | None = None
) -> CostModel:
    """`cost` plus cp > 1 configs derived analytically from its cp = 1 entries (named NAME+cp).

    A CP config splits every sequence over cp ranks: a / cp and b / cp of the measured (tp, pp), plus
    the K/V all-gather (`kv_gather`) at the device's bandwidths. Entries the cost model already has
    (measured cp > 1) are kept as they are. The recompute set carries over to the derived configs.
    `only`, if given, chooses which derived configs to add (a benchmark's CP-only-where-needed model).
    """
    if cost.name.endswith(CP_SUFFIX):
        return cost
    chosen = [
        g for g in cp_configs(cost.configs)
        if g.cp in degrees and g not in cost.configs and (only is None or only(g))
    ]
    return with_cp_configs(cost, chosen, cost.name + CP_SUFFIX)


def cp_coefficients(cost: CostModel, config: ParallelConfig) -> Coefficients:
    """A CP config's coefficients from its cp = 1 base in `cost`: a / cp and b / cp, plus the K/V all-gather."""
    base = ParallelConfig(config.tp, config.pp)
    k = cost.coefficients(base)
    db, dc = kv_gather(cost.model, cost.device, config)
    scale = RECOMPUTE_TIME if cost.recomputes(base) else 1.0  # the all-gather is rerun with the forward
    return Coefficients(k.a / config.cp, k.b / config.cp + db * scale, k.c + dc)


def with_cp_configs(cost: CostModel, configs: Sequence[ParallelConfig], name: str) -> CostModel:
    """`cost` plus these cp > 1 configs derived by `cp_coefficients` (the recompute set carries over)."""
    coefficients = {g: cost.coefficients(g) for g in cost.configs}
    recompute = set(cost.recompute)
    for g in configs:
        coefficients[g] = cp_coefficients(cost, g)
        if cost.recomputes(ParallelConfig(g.tp, g.pp)):
            recompute.add(g)
    return cost.with_configs(name, coefficients, recompute)
