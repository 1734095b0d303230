"""`hydraulis bench`: every policy on built-in scenarios, with the same cost model and batches.

Scenarios are a small data table. A scenario's `lengths` names a source in
LENGTH_SOURCES: a function from the scenario's maximum length to a length
histogram. Synthetic mixtures are registered here; real corpora register
theirs with `register_length_source`.

Each policy gets the same global batches; the pool (for the planner and the
reference) is built from other batches of the same distribution, so it is not
fitted to the batches it is measured on.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field

import numpy as np

from hydraulis.baselines import POLICIES, make_policy
from hydraulis.cost import load_cost_model
from hydraulis.cost.model import CostModel
from hydraulis.data.synthetic import MIXTURES
from hydraulis.data.workload import sample_batches
from hydraulis.errors import HydraulisError
from hydraulis.planner.bounds import lower_bound
from hydraulis.planner.policy import PolicyContext
from hydraulis.planner.schedule import Schedule, check_schedule
from hydraulis.specs import ClusterSpec

BENCH_SCHEMA = "hydraulis.bench/1"
BASELINE = "megatron"
INTERLEAVING = ("megatron", "token-balanced", "flops-balanced", "hotspa")  # baselines that run the recipes' vp
REFERENCE = "hydraulis-reference"

LengthSource = Callable[[int], tuple[np.ndarray, np.ndarray]]
LENGTH_SOURCES: dict[str, LengthSource] = {name: m.histogram for name, m in MIXTURES.items()}


def register_length_source(name: str, source: LengthSource) -> None:
    """Add a lengths source (max_length -> (lengths, counts)), e.g. a real corpus's histogram."""
    LENGTH_SOURCES[name] = source


def corpus_source(name: str) -> LengthSource:
    """A built-in corpus's pieces after the sampler's split policy, as a histogram (built on first use)."""

    def source(max_length: int) -> tuple[np.ndarray, np.ndarray]:
        from hydraulis.data.builtin import corpus_lengths
        from hydraulis.data.sampler import TokenBudgetSampler

        pieces = TokenBudgetSampler(corpus_lengths(name), max(max_length, 1), max_length).piece_lengths()
        lengths, counts = np.unique(pieces, return_counts=True)
        return lengths, counts.astype(np.float64)

    return source


for _corpus in ("python-stdlib", "wiki-sample", "bbc-news"):
    register_length_source(_corpus, corpus_source(_corpus))


@dataclass(frozen=True)
class Scenario:
    name: str
    profile: str
    num_gpus: int
    tokens_per_batch: int
    max_length: int
    lengths: str  # a key of LENGTH_SOURCES
    batches: int = 3
    seed: int = 1
    group: str = "main"  # a key of GROUPS: `hydraulis bench --group` runs one

    def sample(self, seed: int, count: int | None = None) -> list[np.ndarray]:
        try:
            source = LENGTH_SOURCES[self.lengths]
        except KeyError:
            raise HydraulisError(
                f"scenario {self.name}: unknown lengths source {self.lengths!r}; known: {', '.join(LENGTH_SOURCES)}"
            ) from None
        lengths, counts = source(self.max_length)
        return sample_batches(lengths, counts, self.tokens_per_batch, count or self.batches, seed)


K = 1024


def _scenarios(rows: tuple[tuple[str, str, int, int, int, str], ...], prefix: str = "", **rest) -> list[Scenario]:
    """Scenarios from rows of (name, device, GPUs, K tokens per batch, K max length, lengths source); the model
    is the name's first word (its llama preset), the profile that model on that device with CP."""
    return [
        Scenario(
            name=prefix + name, profile=f"llama-{name.split('-')[0]}@{device}+cp", num_gpus=gpus,
            tokens_per_batch=tokens * K, max_length=length * K, lengths=source, **rest,
        )
        for name, device, gpus, tokens, length, source in rows
    ]


SCENARIOS: tuple[Scenario, ...] = (
    *_scenarios((
        # Real corpora (GPT-2 tokens; documents above the max length split into pieces).
        ("7b-32g-stdlib-256k-32k", "a800-80g", 32, 256, 32, "python-stdlib"),
        ("13b-64g-stdlib-1m-32k", "a800-80g", 64, 1024, 32, "python-stdlib"),
        ("7b-32g-wikisample-512k-16k", "a800-80g", 32, 512, 16, "wiki-sample"),
        ("32b-64g-wikisample-1m-32k", "a800-80g", 64, 1024, 32, "wiki-sample"),
        ("7b-16g-bbc-256k-8k", "a800-80g", 16, 256, 8, "bbc-news"),
        # Synthetic mixtures calibrated to public statistics.
        ("7b-16g-wiki-256k-8k", "a800-80g", 16, 256, 8, "wiki"),
        ("7b-32g-wiki-512k-16k", "a800-80g", 32, 512, 16, "wiki"),
        ("7b-32g-code-256k-32k", "a800-80g", 32, 256, 32, "code"),
        ("7b-64g-wiki-1m-32k", "a800-80g", 64, 1024, 32, "wiki"),
        ("13b-32g-code-512k-16k", "a800-80g", 32, 512, 16, "code"),
        ("13b-64g-wiki-1m-32k", "a800-80g", 64, 1024, 32, "wiki"),
        ("32b-16g-code-256k-16k", "a800-80g", 16, 256, 16, "code"),
        ("32b-64g-wiki-1m-32k", "a800-80g", 64, 1024, 32, "wiki"),
    )),
    # Long context, where memory binds (issue 42): python-stdlib's longest file is 414K GPT-2 tokens (wiki-sample's
    # 54K, too short for these lengths); longmix is ProLong's long-context mix (data/synthetic.py).
    *_scenarios((
        ("7b-32g-stdlib-1m-128k", "a800-80g", 32, 1024, 128, "python-stdlib"),
        ("13b-64g-stdlib-1m-256k", "a800-80g", 64, 1024, 256, "python-stdlib"),
        ("7b-128g-stdlib-2m-512k", "a800-80g", 128, 2048, 512, "python-stdlib"),
        ("70b-64g-stdlib-1m-64k", "h100-80g", 64, 1024, 64, "python-stdlib"),
        ("7b-64g-longmix-2m-256k", "a800-80g", 64, 2048, 256, "longmix"),
        ("13b-128g-longmix-2m-512k", "a800-80g", 128, 2048, 512, "longmix"),
        ("70b-128g-longmix-2m-128k", "h100-80g", 128, 2048, 128, "longmix"),
        ("70b-256g-longmix-4m-64k", "h100-80g", 256, 4096, 64, "longmix"),
    ), prefix="long-", batches=2, group="long"),
)
GROUPS = ("main", "long")  # main: the 13 scenarios of 8K-32K; long: 64K-512K


def get_scenarios(names: Iterable[str] | None, group: str | None = None) -> list[Scenario]:
    """The named scenarios, else those of `group`, else all."""
    known = {s.name: s for s in SCENARIOS}
    if group is not None and group not in GROUPS:
        raise HydraulisError(f"unknown scenario group {group!r}; groups: {', '.join(GROUPS)}")
    if not names:
        return [s for s in SCENARIOS if group is None or s.group == group]
    out = []
    for n in names:
        if n not in known:
            raise HydraulisError(f"unknown scenario {n!r}; scenarios: {', '.join(known)}")
        out.append(known[n])
    return out


@dataclass(frozen=True)
class PolicyResult:
    scenario: str
    policy: str
    tokens_per_s: float
    balance_efficiency: float  # mean over batches of lower bound / iteration time
    planning_ms: float  # mean per iteration
    iteration_times_s: tuple[float, ...]
    deployments: dict[str, int] = field(default_factory=dict)  # phase deployment -> how often used
    speedup_vs_megatron: float = math.nan
    tokens_per_s_vp1: float | None = None  # a baseline that interleaves: its tokens/s under plain 1F1B (before)


def run_policies(
    name: str,
    ctx: PolicyContext,
    batches: list[np.ndarray],
    policies: Iterable[str],
    keep: Callable[[str, int, Schedule], None] | None = None,
    memory_policies: bool = False,
) -> list[PolicyResult]:
    """Every policy on the same batches and context; `keep(policy, step, schedule)` sees each schedule.

    Where no config packs the run's longest sequence otherwise, every baseline recomputes in the configs that
    hold it only so, for all their micro-batches, as its users would switch on for the run: full recompute, or
    the lightest uniform policy that holds it (`PolicyContext.recompute_where_needed`), whichever runs its
    batches faster. With `memory_policies` hydraulis also chooses a policy per micro-batch
    (`CostModel.with_policies`), its own lever, beside the same run-wide choice (without recompute, or with
    full recompute where needed: the faster). Balance efficiency divides one lower bound per batch, the least
    over the cost models the policies plan on (megatron-dcp's adds its CP group sizes), by each iteration's
    time: how far each policy is from the best possible.
    """
    runs, vp1 = [], {}
    contexts = [ctx]
    if ctx.user_pool is None:  # the user's pool is planned as given
        contexts = list({c.cost.name: c for c in (ctx.recompute_where_needed(lone=False, lightest=lightest)
                                                     for lightest in (False, True))}.values())
    for policy_name in policies:
        if policy_name == "hydraulis" and memory_policies:
            tried = [_run_policy(policy_name, c, batches) for c in hydraulis_contexts(ctx)]
        else:
            tried = [_run_policy(policy_name, c, batches) for c in contexts]
        run = min(tried, key=lambda r: sum(r[1]))
        if policy_name in INTERLEAVING and ctx.interleave:  # before it gained interleaving, the same way
            before = min((_run_policy(policy_name, dataclasses.replace(c, interleave=False), batches)
                          for c in contexts), key=lambda r: sum(r[1]))
            vp1[policy_name] = sum(int(b.sum()) for b in batches) / sum(before[1])
            run = min(run, before, key=lambda r: sum(r[1]))  # its users keep plain 1F1B where that is faster
        if keep:
            for step, schedule in enumerate(run[4]):
                keep(policy_name, step, schedule)
        runs.append((policy_name, *run[:4]))
    bounds = scenario_bounds(batches, [r[1] for r in runs], ctx.num_gpus, ctx.interleave)
    tokens = sum(int(b.sum()) for b in batches)
    results = [
        PolicyResult(
            scenario=name,
            policy=policy_name,
            tokens_per_s=tokens / sum(times),
            balance_efficiency=float(np.mean([lb / t for lb, t in zip(bounds, times, strict=True)])),
            planning_ms=float(np.mean(planning) * 1e3),
            iteration_times_s=tuple(times),
            deployments=used,
            tokens_per_s_vp1=vp1.get(policy_name),
        )
        for policy_name, _, times, planning, used in runs
    ]
    base = next((r.tokens_per_s for r in results if r.policy == BASELINE), math.nan)
    return [dataclasses.replace(r, speedup_vs_megatron=r.tokens_per_s / base) for r in results]


def hydraulis_contexts(ctx: PolicyContext) -> list[PolicyContext]:
    """The contexts the bench plans hydraulis in, of which `run_policies` keeps the fastest: its own lever, a memory
    policy per micro-batch (`CostModel.with_policies`), beside the baselines' run-wide choice (as given, or with
    full recompute where needed: `PolicyContext.recompute_where_needed`; a user's pool as given), each with the
    configs' interleaved forms where `ctx` interleaves (`CostModel.with_interleaving`) and, as the baselines,
    plain 1F1B, where interleaving's larger config space proposes a slower pool."""
    run_wide = [ctx] if ctx.user_pool is not None else [ctx, ctx.recompute_where_needed(lone=False)]
    out = []
    for c in {c.cost.name: c for c in run_wide}.values():
        for on in dict.fromkeys((ctx.interleave, False)):
            cost = (c.cost.with_interleaving() if on else c.cost).with_policies(True)
            cost.name = f"{cost.name}+policies"
            out.append(dataclasses.replace(c, interleave=on, cost=cost))
    return out


def _run_policy(
    policy_name: str, ctx: PolicyContext, batches: list[np.ndarray]
) -> tuple[CostModel, list[float], list[float], dict[str, int], list[Schedule]]:
    """One policy on the batches: its cost model, iteration and planning times, deployments used, schedules."""
    policy = make_policy(policy_name, ctx)
    times, planning, used, schedules = [], [], {}, []
    for step, b in enumerate(batches):
        schedule = policy.schedule(b, step)
        check_schedule(schedule, policy.cost)  # every sequence once, caps hold: else tokens/s would lie
        schedules.append(schedule)
        times.append(schedule.iteration_time_s)
        planning.append(schedule.planning_time_s)
        for phase in schedule.phases:
            used[str(phase.deployment)] = used.get(str(phase.deployment), 0) + 1
    return policy.cost, times, planning, used, schedules


def scenario_bounds(
    batches: list[np.ndarray], costs: list[CostModel], num_gpus: int, interleave: bool = False
) -> list[float]:
    """Per batch, the least lower bound over these cost models (those that hold the batch at all; `interleave`:
    with their configs' interleaved bubbles too)."""
    unique = {c.name: c for c in costs}.values()
    out = []
    for b in batches:
        held = []
        for cost in unique:
            with contextlib.suppress(HydraulisError):  # a model that holds no config for it bounds nothing
                held.append(lower_bound(b, cost, num_gpus, interleave=interleave))
        out.append(min(held) if held else math.nan)
    return out


def run_scenario(
    scenario: Scenario, policies: Iterable[str], interleave: bool = True, zero_bubble: bool = True
) -> list[PolicyResult]:
    """`interleave` off: every policy runs plain 1F1B, the bench as it was before interleaving; `zero_bubble` off:
    hydraulis runs fused backwards, as before it deferred weight gradients."""
    cost = load_cost_model(scenario.profile)
    cluster = ClusterSpec(scenario.num_gpus)
    batches = scenario.sample(scenario.seed)
    ctx = PolicyContext.build(cost, cluster, batches, sample=scenario.sample(scenario.seed + 1000, 4))
    ctx = dataclasses.replace(ctx, interleave=interleave, zero_bubble=zero_bubble)
    return run_policies(scenario.name, ctx, batches, policies, memory_policies=True)


def geomean(values: list[float]) -> float:
    return float(np.exp(np.mean(np.log(values))))


def best_others(results: list[PolicyResult], scenarios: list[Scenario]) -> dict[str, dict]:
    """Per scenario: the fastest policy other than hydraulis, and hydraulis's throughput over it."""
    by = {(r.scenario, r.policy): r for r in results}
    out = {}
    for s in scenarios:
        ours = by.get((s.name, "hydraulis"))
        others = [r for r in results if r.scenario == s.name and r.policy != "hydraulis"]
        if ours is None or not others:
            continue
        best = max(others, key=lambda r: r.tokens_per_s)
        out[s.name] = {"policy": best.policy, "speedup": ours.tokens_per_s / best.tokens_per_s}
    return out


def summarize(results: list[PolicyResult], scenarios: list[Scenario]) -> dict:
    """The issue's targets, measured: hydraulis against the best other policy of each scenario first."""
    by = {(r.scenario, r.policy): r for r in results}
    out: dict = {}
    best = best_others(results, scenarios)
    if best:
        out["best_other"] = best
        out["speedup_vs_best_other_min"] = min(b["speedup"] for b in best.values())
        out["speedup_vs_best_other_geomean"] = geomean([b["speedup"] for b in best.values()])
        for group in GROUPS:
            mine = [b["speedup"] for s in scenarios if s.group == group and (b := best.get(s.name))]
            if mine:
                out[f"speedup_vs_best_other_geomean_{group}"] = geomean(mine)
    ours = [r for r in results if r.policy == "hydraulis"]
    if ours:
        out["min_balance_efficiency"] = min(r.balance_efficiency for r in ours)
        out["max_planning_ms"] = max(r.planning_ms for r in ours)
    vs_ref = [
        by[(s.name, "hydraulis")].tokens_per_s / by[(s.name, REFERENCE)].tokens_per_s
        for s in scenarios
        if (s.name, "hydraulis") in by and (s.name, REFERENCE) in by
    ]
    if vs_ref:
        out["speedup_vs_reference_geomean"] = geomean(vs_ref)
        out["speedup_vs_reference_min"] = float(min(vs_ref))
    long = [
        by[(s.name, "hydraulis")].speedup_vs_megatron
        for s in scenarios
        if s.max_length >= 16 * K and (s.name, "hydraulis") in by and (s.name, BASELINE) in by
    ]
    if long:
        out["speedup_vs_megatron_min_long"] = float(min(long))
    return out


def run_bench(
    scenarios: list[Scenario], policies: list[str], on_scenario: Callable[[Scenario], None] | None = None,
    interleave: bool = True,
    zero_bubble: bool = True,
) -> dict:
    for p in policies:
        if p not in POLICIES:
            raise HydraulisError(f"unknown policy {p!r}; policies: {', '.join(POLICIES)}")
    if BASELINE not in policies:
        policies = [BASELINE, *policies]
    start = time.perf_counter()
    results: list[PolicyResult] = []
    for s in scenarios:
        results += run_scenario(s, policies, interleave, zero_bubble)
        if on_scenario:
            on_scenario(s)
    return {
        "schema": BENCH_SCHEMA,
        "scenarios": [asdict(s) for s in scenarios],
        "policies": policies,
        "results": [{**{k: v for k, v in asdict(r).items() if v is not None},  # tokens_per_s_vp1 where it is one
                     "iteration_times_s": list(r.iteration_times_s)} for r in results],
        "summary": summarize(results, scenarios),
        "wall_s": time.perf_counter() - start,
    }
