"""A training job's own proposal (`pool = "auto"`, training/job.py `propose_pool`) weighs interleaved 1F1B as
`hydraulis propose --interleave` does, where the model's layers split into chunks, unless `[parallel] interleave`
is off. No torch: the job's cost model is the analytic one, as the bench's."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from hydraulis.cost import AnalyticCostModel
from hydraulis.data.sampler import TokenBudgetSampler
from hydraulis.parallel import ParallelConfig
from hydraulis.planner.phases import PhasedPlanner
from hydraulis.planner.pool import check_job_pool
from hydraulis.specs import ClusterSpec, get_device, get_model
from hydraulis.training.config import parse_config
from hydraulis.training.job import propose_pool
from hydraulis.training.job_config import DataChoice, ParallelChoice
from hydraulis.training.job_cost import for_job

GPUS = 4


def job_pools(layers: int, memory_per_rank: str):
    """llama-7b's shape with `layers` on 4 A800s held to `memory_per_rank`: the job's pool with interleaving
    weighed and without, its cost model, its sample batches and its model."""
    spec = replace(get_model("llama-7b"), layers=layers)
    values = parse_config({"data": {"tokens_per_batch": 16384, "max_len": 2048},
                           "parallel": {"memory_per_rank": memory_per_rank}}).resolved_values()
    data = DataChoice.of(values["data"])
    lengths = np.clip(np.random.default_rng(0).lognormal(7, 1.2, 3000).astype(np.int64), 16, None)
    sampler = TokenBudgetSampler(lengths, data.tokens_per_batch, data.max_len, data.seed, data.overlong)
    pools = {}
    for interleave in (True, False):
        parallel = ParallelChoice.of({**values["parallel"], "interleave": interleave})
        cost = for_job(AnalyticCostModel(spec, get_device("a800-80g")), parallel, "bf16")
        pools[interleave] = propose_pool(cost, ClusterSpec(GPUS), sampler, data, parallel)
    batches = [b.lengths for b in sampler.batches(4)]
    return pools, cost, batches, spec


def vps(pool) -> set[int]:
    return {g.vp for d in pool for g in d.configs}


def test_a_deep_model_that_must_pipeline_gets_an_interleaved_pool_that_plans_faster():
    """At 48 GB a rank llama-7b needs pp 4 or tp 2; 8 layers a stage split into chunks, and the bubble vp cuts
    makes tp1pp4 interleaved faster than any plain config: the job proposes it (checked as a run's pool, on
    the plain cost model it trains on), its plans faster on the run's batches; `interleave = false` none."""
    pools, cost, batches, spec = job_pools(32, "48GB")
    assert max(vps(pools[True])) > 1 and vps(pools[False]) == {1}, pools
    check_job_pool(pools[True], GPUS, spec, cost, 2048)  # every config splits the model; the runtime runs it
    assert all(g.pp >= 2 and spec.layers % (g.pp * g.vp) == 0 for d in pools[True] for g in d.configs if g.vp > 1)
    times = {k: sum(PhasedPlanner(cost, GPUS, list(pool)).schedule(b).iteration_time_s for b in batches)
             for k, pool in pools.items()}
    assert times[True] < times[False], times


def test_stages_of_a_prime_layer_count_interleave_in_chunks_of_one_layer():
    """28 layers: pp 4 stages of 7, a prime, which the recipes' chunks of 2 layers or more do not split
    (`ParallelConfig.vp_choices`); hydraulis's one-layer chunks do (`planned_vp_choices`): the proposal, interleaving
    weighed, holds a pp 4 replica at vp 7, which the runtime lays out (one layer a chunk); its plans are no slower."""
    pools, cost, batches, spec = job_pools(28, "36GB")
    assert ParallelConfig(1, 4).vp_choices(spec) == () and ParallelConfig(1, 4).planned_vp_choices(spec) == (7,)
    assert 7 in {g.vp for d in pools[True] for g in d.configs if g.pp == 4}, pools
    check_job_pool(pools[True], GPUS, spec, cost, 2048)
    times = {k: sum(PhasedPlanner(cost, GPUS, list(pool)).schedule(b).iteration_time_s for b in batches)
             for k, pool in pools.items()}
    assert times[True] <= times[False], times  # the planner takes vp 7 only where it pays
