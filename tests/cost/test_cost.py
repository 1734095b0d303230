from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hydraulis.cost import AnalyticCostModel, ProfiledCostModel, load_cost_model
from hydraulis.cost.fit import fit_coefficients
from hydraulis.errors import HydraulisError
from hydraulis.parallel import Deployment, ParallelConfig
from hydraulis.specs import get_device, get_model

P = ParallelConfig


def hand_cap(tp: int, pp: int, gpus: int) -> int:
    """llama-7b's A800 cap, by hand from docs/design.md section 4: bf16 parameters and gradient sums (2 + 2
    bytes) and 12 owned bytes per parameter over all GPUs (fp32 master and moments; the 2-byte reduced
    gradient exists from the reduce on); per token (pp - s) (L/pp) (H/tp) A_tp activation bytes on stage s
    (1F1B keeps pp - s micro-batches in flight there; the published factor, its head included); on the last
    stage the head's fp32 gradient sum (4 V H / tp) and, beside the activations, the loss's chunk of logits
    in flight (2^24 of them in bf16 and fp32). The exchange's two 256 MiB buckets, its fp32 scratch of half
    a bucket and the reduced gradient take what the last block freed: one block of a cap's tokens holds more."""
    L, H, F, V, A = 32, 4096, 11008, 30592, {1: 38, 2: 39, 4: 42, 8: 48}[tp]
    layer = 4 * H * H + 3 * H * F
    total = L * (layer + 2 * H) + 2 * V * H + H
    budget = 85198897152 - 6442450944 - 5242880000
    caps = []
    for stage in {0, pp - 1}:
        shard = L // pp * (layer // tp + 2 * H) + (V * H // tp if stage == 0 else 0)
        beside = 0
        per_token = (pp - stage) * (L // pp) * H / tp * A
        if stage == pp - 1:
            shard += V * H // tp + H
            columns = V // tp
            rows = max(256, 2**24 // columns)
            beside = 4 * columns * H + max(6 * rows * columns, 2 * (rows + H) * columns)
        state = shard * (2 + 2) + -(-total // gpus) * 12
        cap = int((budget - state - beside) / per_token) // 128 * 128
        assert cap * H / tp * A > 2.5 * 256 * 2**20 + 2 * total / gpus  # one block of the cap's tokens: more
        caps.append(cap)
    return min(caps)


@pytest.mark.parametrize(("config", "cap"), [(P(1, 2), 11520), (P(2, 1), 22272), (P(4, 1), 46464), (P(8, 1), 85760)])
def test_7b_caps_count_lean_state_and_the_loss_head(config, cap):
    assert load_cost_model("llama-7b@a800-80g").cap(config, 32) == hand_cap(config.tp, config.pp, 32) == cap


def test_caps_are_multiples_of_128_and_grow_with_sharding():
    cost = load_cost_model("llama-13b@a800-80g")
    caps = cost.caps(64)
    assert all(v % 128 == 0 for v in caps.values())
    assert caps[P(8, 1)] > caps[P(4, 1)] > caps[P(2, 1)]
    # More GPUs shard the optimizer states thinner: caps never shrink.
    assert all(cost.cap(c, 64) >= cost.cap(c, 16) for c in caps)


def test_stage_time_is_the_quadratic_form():
    cost = load_cost_model("llama-7b@a800-80g")
    c = cost.coefficients(P(2, 1))
    s = np.array([100, 2000, 4096])
    assert cost.stage_time(P(2, 1), s) == pytest.approx(c.a * (s**2).sum() + c.b * s.sum() + c.c)
    assert c.c == pytest.approx(65.1789772727277e-3)


def test_cost_matrix_is_every_configs_sequence_costs():
    """One row per config, each the config's per-sequence costs (its speed is the planner benchmark's concern)."""
    cost = AnalyticCostModel(get_model("llama-70b"), get_device("h100-80g"))
    lengths = np.random.default_rng(0).integers(1, 32768, size=100_000)
    configs = cost.configs[:20]
    m = cost.cost_matrix(lengths, configs)
    assert m.shape == (20, 100_000)
    for i in (0, 3, 19):
        assert np.allclose(m[i], cost.seq_costs(configs[i], lengths))


def test_analytic_agrees_with_published_profile_on_time_and_counts_this_runtimes_activations():
    """The analytic caps count this runtime's own activations (activations.py). With its fused norms and SwiGLU
    it keeps less per token than the published system at tp1, and with sequence parallelism about as much at
    tp2; with more TP ever more, for the column linears keep their all-gathered input whole (without SP the
    norms too)."""
    profiled = load_cost_model("llama-7b@a800-80g")
    analytic = AnalyticCostModel(profiled.model, profiled.device)
    sp = analytic.for_job(None, 2, sequence_parallel=True)
    ratios = []
    for config in (P(1, 2), P(2, 1), P(4, 1), P(8, 1)):
        s = [8192]
        assert analytic.stage_time(config, s) == pytest.approx(profiled.stage_time(config, s), rel=0.3)
        ratios.append(sp.cap(config, 32) / profiled.cap(config, 32))
        assert analytic.cap(config, 32) <= sp.cap(config, 32)
    assert ratios[0] > 1.05 and ratios[1] > 0.98 and ratios == sorted(ratios, reverse=True) and ratios[3] < 0.8


def test_min_efficient_tokens():
    cost = load_cost_model("llama-7b@a800-80g")
    assert cost.min_efficient_tokens(P(8, 1)) == 1024
    assert cost.min_efficient_tokens(P(2, 2)) == 512


def test_fit_recovers_coefficients():
    rng = np.random.default_rng(1)
    mbs = [list(rng.integers(64, 4096, size=rng.integers(1, 6))) for _ in range(40)]
    a, b, c = 2e-9, 9e-5, 0.02
    times = [a * sum(s * s for s in mb) + b * sum(mb) + c for mb in mbs]
    fit = fit_coefficients(mbs, times)
    assert fit.a == pytest.approx(a, rel=1e-6)
    assert fit.b == pytest.approx(b, rel=1e-6)
    assert fit.c == pytest.approx(c, rel=1e-6)


def _profile_dict():
    return json.loads(
        (
            ProfiledCostModel.preset.__func__.__globals__["resources"].files("hydraulis.cost")
            / "profiles"
            / "llama-7b-a800.json"
        ).read_text()
    )


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d.pop("time_ms"), "missing field 'time_ms'"),
        (lambda d: d["time_ms"][0].update(a="fast"), r"time_ms\[0\]\.a: expected a finite number"),
        (lambda d: d["time_ms"][0].update(tp=-1), r"time_ms\[0\]\.tp: must be at least 1"),
        (lambda d: d["memory"].pop("safety_margin_bytes"), "safety_margin_bytes"),
        (lambda d: d.update(schema="other/1"), "schema is 'other/1'"),
        (lambda d: d["time_ms"].append(dict(d["time_ms"][0])), "appears twice"),
        (
            lambda d: d["memory"]["activation_bytes_per_token_hidden_layer"].update({"2": 0}),
            r"activation_bytes_per_token_hidden_layer\.2: must be positive",
        ),
    ],
)
def test_malformed_profile_is_named(tmp_path, mutate, message):
    data = _profile_dict()
    mutate(data)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    with pytest.raises(HydraulisError, match=message):
        ProfiledCostModel.from_file(path)


def test_not_json_names_line(tmp_path):
    path = tmp_path / "p.json"
    path.write_text('{"schema": "hydraulis.profile/1",\n oops}')
    with pytest.raises(HydraulisError, match="line 2"):
        load_cost_model(str(path))


def test_a_profile_without_per_micro_batch_overhead_plans():
    """c = 0 is a valid measurement: dispatch then packs as many micro-batches as the caps allow."""
    from hydraulis.planner.planner import Planner
    from hydraulis.specs import ClusterSpec

    data = _profile_dict()
    for row in data["time_ms"]:
        row["c"] = 0.0
    cost = ProfiledCostModel.from_dict(data)
    pool = [Deployment.parse(t, ClusterSpec(16)) for t in ("4x(tp2,pp2)", "2x(tp2,pp4)")]
    lengths = np.random.default_rng(0).integers(100, 6000, 80)
    plan = Planner(cost, 16, pool).plan(lengths)
    plan.validate(cost, 16)
    assert np.isfinite(plan.predicted_time_s) and plan.predicted_time_s > 0


def test_analytic_context_parallelism_splits_per_token_work_too():
    from hydraulis.cost.context_parallel import kv_gather

    model, device = get_model("llama-7b"), get_device("a800-80g")
    configs = [ParallelConfig(2, 1), ParallelConfig(2, 1, 2)]
    cost = AnalyticCostModel(model, device, configs=configs)
    one, two = cost.coefficients(configs[0]), cost.coefficients(configs[1])
    kv_b, kv_c = kv_gather(model, device, configs[1])
    assert two.a == pytest.approx(one.a / 2)
    assert two.b == pytest.approx(one.b / 2 + kv_b) and kv_b > 0
    assert two.c == pytest.approx(one.c + kv_c) and kv_c > 0


def test_lower_bound_without_a_config_that_fits_is_a_clear_error():
    from hydraulis.planner.bounds import lower_bound

    cost = load_cost_model("llama-7b@a800-80g")  # its smallest config takes 2 GPUs
    with pytest.raises(HydraulisError, match="no parallel config of llama-7b@a800-80g fits 1 GPU"):
        lower_bound(np.array([100, 200]), cost, 1)
    # On 2 GPUs the 12 owned bytes per parameter (40 GB) and the reduced gradient's 2 (beside the reduce, which
    # waits until enough blocks are through backward) leave room for a little: the bf16 shard and its bf16
    # gradient sums (13 GB) and 7,424 tokens; as a replica's only micro-batch (in flight once) 10,240 tokens, so
    # an 8,192-token document fits alone and a 12,288-token one fits no config.
    assert cost.caps(2) == {P(1, 2): 3840, P(2, 1): 7424}
    assert lower_bound(np.array([100, 8192]), cost, 2) > 0
    with pytest.raises(HydraulisError, match="largest lone cap 10240"):
        lower_bound(np.array([100, 12288]), cost, 2)
    assert lower_bound(np.array([100, 200]), cost, 2) > 0


def test_caps_are_kept_per_memory_model_so_a_copy_with_another_budget_has_its_own():
    cost = load_cost_model("llama-7b@a800-80g")
    g = P(2, 1)
    before = cost.cap(g, 32), cost.lone_cap(g, 32)
    half = cost.for_job(cost.memory.memory_bytes // 2, cost.memory.compute_dtype_bytes)
    assert half.cap(g, 32) == half.memory.cap(g, half.model, 32) < before[0]
    assert half.lone_cap(g, 32) == half.memory.cap(g, half.model, 32, micro_batches=1) < before[1]
    assert (cost.cap(g, 32), cost.lone_cap(g, 32)) == before == (
        cost.memory.cap(g, cost.model, 32),
        cost.memory.cap(g, cost.model, 32, micro_batches=1),
    )


def test_recompute_raises_the_cap_and_costs_a_forward():
    from hydraulis.cost import AnalyticCostModel
    from hydraulis.cost.policies import RECOMPUTE_TIME
    from hydraulis.parallel import ParallelConfig
    from hydraulis.specs import get_device, get_model

    cost = AnalyticCostModel(get_model("llama-7b"), get_device("a800-80g"))
    g, other = ParallelConfig(2, 1), ParallelConfig(4, 1)
    rc = cost.with_recompute([g])
    assert rc.cap(g, 32) > 2 * cost.cap(g, 32)
    assert rc.cap(other, 32) == cost.cap(other, 32)
    i = cost.index(g)
    assert rc.a[i] == pytest.approx(cost.a[i] * RECOMPUTE_TIME) and rc.b[i] == pytest.approx(cost.b[i] * RECOMPUTE_TIME)
    assert rc.c[i] == cost.c[i] and cost.recompute == frozenset() and rc.recompute == {g}
    deep = ParallelConfig(2, 4)
    assert cost.with_recompute([deep.interleaved(2)]).recomputes(deep.interleaved(4))  # every vp of its GPUs
    assert rc.recomputes(g) and not rc.recomputes(other) and not cost.recomputes(g)
    whole = AnalyticCostModel(get_model("llama-7b"), get_device("a800-80g"), recompute=True)
    assert whole.recompute == set(whole.configs) and whole.cap(g, 32) == rc.cap(g, 32)


# -- context parallelism --------------------------------------------------------------------------------


@pytest.mark.parametrize("device", ["a100-40g", "a800-80g", "h100-80g", "h200-141g", "cpu"])
def test_kv_gather_is_the_cp_groups_kv_bytes_at_the_right_link(device):
    from hydraulis.cost.context_parallel import kv_gather, kv_gather_bytes

    spec, dev = get_model("llama-70b"), get_device(device)  # GQA: 8 KV heads of 128
    g = ParallelConfig(4, 2, 4)
    # Per token, per stage: (K + V) x (all-gather forward + reduce-scatter backward) x L/pp layers x the
    # TP rank's 2 KV heads x 2 bytes x the (cp - 1) / cp a rank lacks.
    assert kv_gather_bytes(spec, g) == pytest.approx(2 * 2 * 40 * 256 * 2 * 3 / 4)
    b, c = kv_gather(spec, dev, g)
    spans = g.group_size > dev.gpus_per_node
    assert b == pytest.approx(kv_gather_bytes(spec, g) / (dev.inter_node_bw if spans else dev.intra_node_bw))
    assert c == pytest.approx(2 * 40 * 3 * dev.p2p_latency_s)
    # More TP ranks than KV heads: each holds one whole head.
    assert kv_gather_bytes(spec, ParallelConfig(16, 1, 2)) == pytest.approx(2 * 2 * 80 * 128 * 2 / 2)
    assert kv_gather(spec, dev, ParallelConfig(4, 2)) == (0.0, 0.0)


def test_kv_gather_across_nodes_costs_the_nic():
    from hydraulis.cost.context_parallel import kv_gather

    spec, dev = get_model("llama-7b"), get_device("a800-80g")
    inside, across = kv_gather(spec, dev, ParallelConfig(2, 1, 4)), kv_gather(spec, dev, ParallelConfig(8, 1, 2))
    # tp8cp2 moves a quarter of tp2cp4's bytes per token (tp 4x, (cp-1)/cp 2/3x) but over an 8x slower link.
    assert across[0] / inside[0] == pytest.approx((1 / 4) * (1 / 2) / (3 / 4) * 8)


@pytest.mark.parametrize("profile", ["llama-7b@a800-80g", "llama-13b@a800-80g", "llama-32b@a800-80g"])
def test_shipped_profiles_extend_to_cp_analytically(profile):
    from hydraulis.cost.context_parallel import CP_DEGREES, kv_gather

    base = load_cost_model(profile)
    cost = load_cost_model(profile + "+cp")
    assert cost.name == profile + "+cp"  # labelled as the analytic extension, and loadable by that name
    assert set(base.configs) < set(cost.configs)
    assert all(g.cp in (1, *CP_DEGREES) for g in cost.configs)
    assert {g.pp for g in cost.configs if g.cp > 1} == {g.pp for g in base.configs}  # CP beside any PP
    for g in (g for g in cost.configs if g.cp > 1):
        k, one = cost.coefficients(g), base.coefficients(ParallelConfig(g.tp, g.pp))
        kv_b, kv_c = kv_gather(cost.model, cost.device, g)
        assert (k.a, k.b, k.c) == pytest.approx((one.a / g.cp, one.b / g.cp + kv_b, one.c + kv_c))
        assert cost.min_efficient_tokens(g) == base.min_efficient_tokens(ParallelConfig(g.tp, g.pp)) * g.cp
    for g in base.configs:  # measured entries stay as measured
        assert cost.coefficients(g) == base.coefficients(g) and cost.cap(g, 64) == base.cap(g, 64)


def test_analytic_cp_is_opt_in_and_matches_the_extension():
    from hydraulis.cost import extend_to_cp

    plain = load_cost_model("llama-7b@h100-80g")
    assert all(g.cp == 1 for g in plain.configs)  # the runtime must support CP before pools get it
    cost = load_cost_model("llama-7b@h100-80g+cp")
    g = ParallelConfig(8, 1, 4)
    direct = AnalyticCostModel(plain.model, plain.device, configs=[ParallelConfig(8, 1), g])
    assert cost.coefficients(g) == pytest.approx(direct.coefficients(g))
    assert extend_to_cp(cost) is cost


def test_a_profile_may_carry_measured_cp_entries():
    data = _profile_dict()
    data["time_ms"].append({"tp": 2, "pp": 2, "cp": 2, "a": 1e-7, "b": 0.02, "c": 20.0})
    cost = ProfiledCostModel.from_dict(data)
    g = ParallelConfig(2, 2, 2)
    assert cost.coefficients(g).c == pytest.approx(0.02)
    from hydraulis.cost import extend_to_cp

    assert extend_to_cp(cost).coefficients(g) == cost.coefficients(g)  # measured wins over the extension


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from([(1, 1), (2, 1), (4, 1), (8, 1), (2, 2), (4, 2)]),
    st.sampled_from([1, 2, 4, 8, 16]),
    st.sampled_from(["llama-7b", "llama-13b", "llama-70b"]),
    st.integers(0, 10**9),
    st.booleans(),
)
def test_cp_caps_hold_exactly(tp_pp, cp, model, seed, recompute):
    from hydraulis.cost import extend_to_cp
    from hydraulis.cost.activations import backward_bytes, head_bytes, loss_transient_bytes
    from hydraulis.cost.memory import CAP_GRANULARITY, DEFAULT_EXCHANGE_BUCKET_BYTES, kv_buffer_bytes, rank_memory

    spec = get_model(model)
    cost = extend_to_cp(AnalyticCostModel(spec, get_device("a800-80g"), recompute=recompute))
    g = ParallelConfig(*tp_pp, cp)
    assert (g in cost.recompute) == recompute
    cap, mem = cost.cap(g, 64), cost.memory
    if cap == 0:
        return
    budget = mem.memory_bytes - mem.safety_margin_bytes - mem.context_overhead_bytes

    def free(stage: int) -> float:  # after the state (bf16 parameters and gradient sums, owned fp32 state)
        r = rank_memory(mem, spec, g, stage, 64, 0, 2, DEFAULT_EXCHANGE_BUCKET_BYTES, recompute)
        return budget - r.params - r.grads - r.owned

    def fits(total: int) -> bool:  # the runtime's bound: ceil(T / cp) + 2 cp tokens, K/V buffers; the loss head
        held = total if cp == 1 else -(-total // cp) + 2 * cp
        # 1F1B keeps pp - s micro-batches in flight on stage s, and one in the last backward, whose reduce takes
        # what its blocks freed (nothing under recompute): it waits for as many as it needs, at most the stage's.
        def used(s: int, count: int | None = None) -> float:
            kv = kv_buffer_bytes(spec, g, recompute, count or g.pp - s)
            return held * mem.bytes_per_token(g, spec, recompute, count or g.pp - s) + total * kv

        block = held * mem.bytes_per_token(g, spec, False) + total * kv_buffer_bytes(spec, g)
        # Two buckets in flight, a half-bucket scratch of the 2-byte reduced gradient, and that gradient itself.
        reduced = 2 * -(-spec.num_params // 64)
        freed = 0 if recompute else block * (spec.layers // g.pp) / spec.layers
        exchange = max(0.0, 2.5 * DEFAULT_EXCHANGE_BUCKET_BYTES + reduced - freed)
        backward = held * backward_bytes(spec, g.tp, 2)  # a layer's backward beside the layers

        def stage_used(s: int) -> float:
            if s < g.pp - 1:
                return max(used(s), used(s, 1) + exchange) + backward
            loss = loss_transient_bytes(spec, g.tp, 2, held)
            return used(s) + head_bytes(spec, g.tp, 2, held) + max(loss, backward + exchange)

        return all(stage_used(s) <= free(s) for s in {0, g.pp - 1})

    assert cap % CAP_GRANULARITY == 0
    assert fits(cap) and not fits(cap + CAP_GRANULARITY)
    assert fits(int(np.random.default_rng(seed).integers(1, cap + 1)))
    if cp > 1:  # about cp x (per-rank cap - 2 cp), less the K/V attention keeps
        assert cap <= cp * (int(free(0) / mem.bytes_per_token(g, spec, recompute)) - 2 * cp)


def test_cp_memory_counts_the_keys_attention_keeps() -> None:
    """Per token of a split document a CP rank keeps its chunks' prefix K/V in every layer in flight
    (L under 1F1B), independent arithmetic: 2 (K, V) x kv columns x 2 bytes x (1 - 1/2cp), plus three
    copies of one layer's K/V live in its backward."""
    from hydraulis.cost import extend_to_cp
    from hydraulis.cost.memory import kv_buffer_bytes

    spec = get_model("llama-7b")
    kv = spec.kv_heads * spec.head_dim
    g = ParallelConfig(1, 1, 4)
    assert kv_buffer_bytes(spec, g) == pytest.approx(spec.layers * 2 * kv * 2 * (1 - 1 / 8) + 3 * 2 * kv * 2)
    assert kv_buffer_bytes(spec, g, recompute=True) == pytest.approx(2 * kv * 2 * (1 - 1 / 8) + 3 * 2 * kv * 2)
    assert kv_buffer_bytes(spec, ParallelConfig(1, 1, 1)) == 0.0
    cost = extend_to_cp(AnalyticCostModel(spec, get_device("a800-80g")))
    # cp grows the cap, but less than cp-fold once the kept K/V are counted
    assert cost.cap(ParallelConfig(1, 1, 1), 8) < cost.cap(g, 8) < 4 * cost.cap(ParallelConfig(1, 1, 1), 8)


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_cp_kept_prefix_follows_the_zigzag_split(cp: int) -> None:
    """The (1 - 1/2cp) of kv_buffer_bytes against the runtime's split: a chunk at [a, b) keeps prefix
    rows 0..a-1, so the fullest rank keeps the largest sum of its chunks' starts; uneven lengths too."""
    from hydraulis.context import split_for_cp
    from hydraulis.cost.activations import KV_BYTES, LIVE_KV_COPIES, kv_buffer_bytes, kv_shard_dim

    spec = get_model("llama-7b")
    per_layer = 2 * kv_shard_dim(spec, 1) * KV_BYTES
    kept_per_token = kv_buffer_bytes(spec, ParallelConfig(1, 1, cp), recompute=True) / per_layer - LIVE_KV_COPIES
    for length in (4096 * cp, 4096 * cp + 2 * cp - 1, 1021):
        split = split_for_cp([length], cp)
        kept = max(int(split.segments(r)[1].sum()) for r in range(cp))
        assert abs(kept - length * kept_per_token) <= 2 * cp, (length, kept)
