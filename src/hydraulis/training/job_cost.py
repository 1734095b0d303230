"""The job's cost model: a profile loaded or measured (`profile = "auto"`), made the job's (its recompute
set, exchange bucket and compute dtype) and held to `[parallel] memory_per_rank`, all before any rank starts.
"""

from __future__ import annotations

from hydraulis.cost import CostModel, load_cost_model
from hydraulis.data.sampler import TokenBudgetSampler
from hydraulis.errors import HydraulisError
from hydraulis.parallel import ParallelConfig
from hydraulis.progress import Log
from hydraulis.specs import DTYPE_BYTES, ModelSpec
from hydraulis.training.auto_profile import AUTO_PROFILE, AutoProfile
from hydraulis.training.job_config import JobConfig, ParallelChoice


def auto_cost(
    job: JobConfig, spec: ModelSpec, configs: tuple[ParallelConfig, ...], world: int, sampler: TokenBudgetSampler,
    env_world: int | None, log: Log,
) -> tuple[CostModel, dict | None, str]:
    """profile = "auto": the cost model of the run directory's own profile (a resume), of a quiet one another
    run on this machine left in the shared cache, or of one measured now; the profile to write into the run
    directory once every check has passed (None: nothing new), and where it came from (`start_lines`)."""
    from hydraulis.cost import ProfiledCostModel

    parallel, train, run_dir = job.parallel, job.train, job.run_dir
    parallel.recompute_configs(configs)  # a bad recompute list fails before minutes of profiling
    request = AutoProfile.of(spec, configs, world, sampler.piece_lengths(), device=train.device, dtype=train.dtype,
                             max_len=job.data.max_len, init_from=job.model.init_from)
    own = request.cached(run_dir / AUTO_PROFILE, log, shared=False)
    shared = None if own is not None or not parallel.profile_cache else request.cached(request.shared_path(), log)
    if own is not None:
        data, fresh, where = own, None, f"{run_dir / AUTO_PROFILE} (this run directory's)"
    elif shared is not None:
        data, fresh, where = shared, shared, f"cached in {request.shared_path()}"
    else:
        data = fresh = request.measure(env_world is not None, log, keep=parallel.profile_cache)
        where = "new for this run"
    cost = for_job(ProfiledCostModel.from_dict(data, str(run_dir / AUTO_PROFILE)), parallel, train.dtype)
    check_budget(cost, parallel, spec=spec, configs=configs, world=world, dtype=train.dtype,
                 max_len=job.data.max_len)
    return cost, fresh, where


def for_job(cost: CostModel, parallel: ParallelChoice, dtype: str) -> CostModel:
    """A loaded cost model made the job's: its recompute set and memory policies, its exchange bucket checked,
    its caps budgeted (for the compute `dtype`)."""
    cost = cost.with_recompute(parallel.recompute_configs(cost.configs))
    cost = cost.with_policies(parallel.memory_policies)
    check_exchange_bucket(parallel.exchange_bucket_mb, cost)
    return budgeted(cost, parallel, dtype)


def check_exchange_bucket(mb: float, cost: CostModel) -> None:
    """An exchange round holds a send and a receive buffer of up to one bucket each (`[parallel]
    exchange_bucket_mb` MiB): both must fit the device."""
    memory = cost.memory.memory_bytes
    if 2 * mb * (1 << 20) > memory:
        raise HydraulisError(
            f"parallel.exchange_bucket_mb {mb:g} is too large for the device's {memory / (1 << 20):.0f} MiB "
            "(an exchange holds two buckets); use a small fraction of it, e.g. 256 on GPUs"
        )


def budgeted(cost: CostModel, parallel: ParallelChoice, dtype: str) -> CostModel:
    """The cost model whose caps are for this job: its compute dtype, exchange bucket, sequence parallelism
    and, with `[parallel] memory_per_rank`, that budget in place of the device's memory."""
    bucket = int(parallel.exchange_bucket_mb * (1 << 20))
    return cost.for_job(parallel.budget_bytes, DTYPE_BYTES[dtype], bucket, parallel.sequence_parallel)


def check_budget(
    cost: CostModel | None, parallel: ParallelChoice, *, spec: ModelSpec, configs: tuple[ParallelConfig, ...],
    world: int, dtype: str, max_len: int,
) -> tuple[ParallelConfig, ...]:
    """The configs whose training state fits `[parallel] memory_per_rank` (all of them without one).

    A config of the pool whose parameters, gradients, owned optimizer state and exchange buffers alone
    exceed the budget is one error line; with pool = "auto" such configs are left out (the profile does
    not measure them), and only none fitting is an error. Before profiling (`cost` None), the state comes
    from the model's shape alone (the analytic memory model).
    """
    if parallel.budget_bytes is None:
        return configs
    given, auto = f"parallel.memory_per_rank {parallel.memory_per_rank}", parallel.pool == "auto"
    measured = cost is not None
    if cost is None:
        from hydraulis.cost import AnalyticCostModel
        from hydraulis.specs import get_device

        cost = budgeted(AnalyticCostModel(spec, get_device("cpu")), parallel, dtype)
    memory, MiB = cost.memory, 1 << 20
    need = {g: memory.state_bytes(g, spec, world) for g in configs}
    fits = tuple(g for g in configs if need[g] <= memory.usable_bytes)
    if fits != configs and not (auto and fits):
        worst = min(configs, key=lambda g: need[g]) if auto else max(configs, key=lambda g: need[g])
        raise HydraulisError(
            f"{given} leaves {memory.usable_bytes / MiB:.1f} MiB per rank after its safety margin, but {worst.name} "
            f"needs {need[worst] / MiB:.1f} MiB before any activation (parameters, gradients, optimizer state, "
            "exchange buffers); raise memory_per_rank" + ("" if auto else " or use configs that shard the model more")
        )
    if auto and measured:  # the proposal's configs: those that hold max_len (an explicit pool: check_job_pool)
        holds = {g: cost.lone_cap(g, world) for g in fits if g in cost.configs}
        best = max(holds, key=holds.get, default=None)
        if best is None or holds[best] < max_len:
            most = f"{holds[best]} tokens ({best.name})" if best is not None else "nothing"
            raise HydraulisError(
                f"{given} holds at most {most} in a micro-batch, less than data.max_len {max_len}; "
                "raise memory_per_rank or lower max_len"
            )
    return fits


def job_cost_model(profile: str, spec: ModelSpec) -> CostModel:
    """load_cost_model, plus `@DEVICE`: the analytic model of the trained model's own shape on DEVICE."""
    if profile.startswith("@"):
        from hydraulis.cost import AnalyticCostModel
        from hydraulis.specs import get_device

        return AnalyticCostModel(spec, get_device(profile[1:]))
    try:
        return load_cost_model(profile)
    except HydraulisError as exc:  # the job's own key, so the command names the config file too
        raise HydraulisError(f'parallel.profile: {exc}; or "auto" (this model measured here first) or @DEVICE '
                             "(the analytic model of this model's shape)") from None
