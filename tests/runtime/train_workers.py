"""Trainer scenarios that the multi-process tests run on every rank, and their single-process reference."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from hydraulis.cost import AnalyticCostModel
from hydraulis.cost.model import CostModel
from hydraulis.cost.policies import LIGHTEST_FIRST
from hydraulis.data.sampler import TokenBudgetSampler
from hydraulis.optim import AdamWSettings, OptimSettings
from hydraulis.parallel import Deployment
from hydraulis.pipeline_order import BACKWARD, FORWARD, stage_order
from hydraulis.planner.plan import IterationPlan, Schedule
from hydraulis.planner.planner import Planner
from hydraulis.planner.schedule import mean_switch_time, phases_time
from hydraulis.runtime import IGNORE_INDEX, StageModel, concatenate_documents, count_targets
from hydraulis.runtime.iteration import WeightSlots
from hydraulis.runtime.optimizer.layout import ShardLayout
from hydraulis.runtime.parallelism.batch import TokenDocuments
from hydraulis.runtime.parallelism.launch import init_distributed
from hydraulis.runtime.trainer import Trainer
from hydraulis.settings import ParallelSettings, TrainerSettings, TrainSettings
from hydraulis.specs import MODELS, ClusterSpec, get_device

SEED = 5
WORLD = 4
# The last deployment interleaves: two model chunks per pipeline rank beside a tp2 replica.
POOL_TEXT = ("1x(tp2,pp1) + 2x(tp1,pp1)", "2x(tp1,pp2)", "1x(tp2,pp2)", "1x(tp1,pp2,vp2) + 1x(tp2,pp1)")
STEPS = 8
CRAFTED = 5  # steps run on plans made here (one with an idle replica); the rest plan inside the trainer
# The deployment of each crafted step: switches every step, back and forth.
CRAFTED_DEPLOYMENTS = (0, 1, 0, 2, 1)
IDLE_STEP = 2  # in this crafted step, replica 2 of deployment 0 gets no micro-batch
# Crafted steps run in phases (runtime/iteration.py): the deployment of each phase, shortest sequences first.
PHASED = {1: (3, 2), 4: (2, 0, 1)}
# Crafted steps whose micro-batches cycle through the memory policies (none, selective, full recompute).
MIXED = (0, 2, 3)
# Between the steps' gradient norms (0.65 to 0.77): clipping is inactive at steps 0, 1, 3 and 6, active at the rest.
GRAD_CLIP = 0.68


def weight_slots(pp: int, vp: int, m: int, stage: int, pattern: str) -> tuple[int, ...]:
    """Hand-made zero-bubble W placements of a stage (`pipeline_order.with_weights`): "fused" (each W right after
    its B), "end" (every W after the stage's last event: the most held), "before-forward" (each W right before
    the stage's next forward, at the end after the last)."""
    order = stage_order(pp, vp, m, stage)
    forwards = [i for i, e in enumerate(order) if e[0] == FORWARD]
    backwards = [i for i, e in enumerate(order) if e[0] == BACKWARD]
    if pattern == "fused":
        return tuple(backwards)
    if pattern == "end":
        return (len(order) - 1,) * len(backwards)
    assert pattern == "before-forward", pattern
    return tuple(next((f - 1 for f in forwards if f > b), len(order) - 1) for b in backwards)


def zero_bubble(patterns: dict[int, str] | str) -> WeightSlots:
    """A trainer's W slots: one pattern (`weight_slots`) for every step, or per step (a step not named: fused)."""

    def slots(plan: IterationPlan, replica: int, stage: int) -> tuple[int, ...]:
        pattern = patterns if isinstance(patterns, str) else patterns.get(plan.step)
        config = plan.deployment.replicas[replica].config
        m = len(plan.replicas[replica].micro_batches)
        return () if pattern is None or m == 0 else weight_slots(config.pp, config.vp, m, stage, pattern)

    return slots


def corpus(vocab: int) -> list[np.ndarray]:
    rng = np.random.default_rng(SEED)
    lengths = rng.integers(4, 120, size=48)
    return [rng.integers(0, vocab, size=int(n)).astype(np.uint16) for n in lengths]


def sampler(docs: list[np.ndarray]) -> TokenBudgetSampler:
    return TokenBudgetSampler([len(d) for d in docs], tokens_per_batch=700, max_len=160, seed=SEED)


def cpu_settings(
    world: int,
    pool: Sequence[str],
    optim: OptimSettings,
    steps: int,
    model: str = "tiny",
    cost: CostModel | None = None,
    **fields: Any,
) -> TrainerSettings:
    """The workers' settings: a model preset, its pool parsed for `world` ranks on one node, the given cost
    model (the analytic CPU one by default); `fields` sets the rest (ParallelSettings.of's or TrainSettings')."""
    spec = MODELS[model]
    cluster = ClusterSpec(world, gpus_per_node=world)
    parallel = {k: fields.pop(k) for k in PARALLEL_FIELDS if k in fields}
    return TrainerSettings(
        model=spec,
        parallel=ParallelSettings.of(
            tuple(Deployment.parse(t, cluster) for t in pool),
            cost if cost is not None else AnalyticCostModel(spec, get_device("cpu")),
            **parallel,
        ),
        optim=optim,
        train=TrainSettings(steps=steps, **fields),
    )


PARALLEL_FIELDS = ("overlap", "sequence_parallel", "exchange_bucket_bytes", "memory_budget_bytes")


def varied(s: TrainerSettings, **changes: Any) -> TrainerSettings:
    """`s` with some of its values changed, resolved as a job's are (ParallelSettings.of: `overlap` in the cost)."""
    p = s.parallel
    now = {"overlap": p.overlap, "sequence_parallel": p.sequence_parallel,
           "exchange_bucket_bytes": p.exchange_bucket_bytes, "memory_budget_bytes": p.memory_budget_bytes}
    parallel = {**now, **{k: changes.pop(k) for k in PARALLEL_FIELDS if k in changes}}
    return dataclasses.replace(s, parallel=ParallelSettings.of(p.pool, p.cost, **parallel),
                               train=dataclasses.replace(s.train, **changes))


def settings(model: str = "tiny", sequence_parallel: bool = False) -> TrainerSettings:
    """eps 1e-6 keeps AdamW well conditioned: with 1e-8, elements whose gradient is at fp32 rounding
    level (sums that cancel) take +-lr steps whose sign depends on summation order, and the two runs
    drift apart by about 1e-5 for reasons that have nothing to do with the distribution."""
    adamw = AdamWSettings(eps=1e-6, weight_decay=0.1, grad_clip=GRAD_CLIP)
    optim = OptimSettings(lr=1e-3, warmup=2, schedule="cosine", adamw=adamw)
    return cpu_settings(
        WORLD, POOL_TEXT, optim, STEPS, model, seed=SEED, sequence_parallel=sequence_parallel, compare_steps=2
    )


def crafted_plans(s: TrainerSettings) -> list[IterationPlan]:
    """Plans of the first CRAFTED batches on chosen deployments, one leaving a replica idle."""
    docs = corpus(s.model.vocab)
    smp = sampler(docs)
    planner = Planner(s.parallel.cost, WORLD, s.parallel.pool)
    plans = []
    for step, k in enumerate(CRAFTED_DEPLOYMENTS):
        plan = planner.plan_on(smp.next_batch().lengths, s.parallel.pool[k], step)
        if step == IDLE_STEP:
            r = plan.replicas
            moved = type(r[0])(r[1].micro_batches + r[2].micro_batches)
            plan = IterationPlan(plan.step, plan.lengths, plan.deployment, (r[0], moved, type(r[0])(())),
                                 plan.predicted_time_s)
        if step in MIXED:
            cycle = [int(p) for p in LIGHTEST_FIRST]
            replicas = [dataclasses.replace(r, policies=tuple(cycle[(i + k + step + 1) % 3] for k, _ in
                                                              enumerate(r.micro_batches)))
                        for i, r in enumerate(plan.replicas)]
            plan = dataclasses.replace(plan, replicas=tuple(replicas))
        plans.append(plan)
    return plans


def crafted_schedules(s: TrainerSettings) -> list[Schedule]:
    """The crafted plans, the PHASED steps instead cut into phases, shortest sequences first."""
    planner = Planner(s.parallel.cost, WORLD, s.parallel.pool)
    return [
        phased(planner, np.asarray(plan.lengths), step, PHASED[step]) if step in PHASED else Schedule.single(plan)
        for step, plan in enumerate(crafted_plans(s))
    ]


def phased(planner: Planner, lengths: np.ndarray, step: int, deployments: tuple[int, ...]) -> Schedule:
    """The batch sorted by length and cut into one part per phase, each planned on its deployment."""
    parts = np.array_split(np.argsort(lengths, kind="stable"), len(deployments))
    plans = tuple(planner.plan_on(lengths[p], planner.pool[k], step) for p, k in zip(parts, deployments, strict=True))
    switch = mean_switch_time(plans, planner.cost)
    return Schedule(step, tuple(int(x) for x in lengths), plans, tuple(tuple(int(i) for i in p) for p in parts),
                    switch, phases_time(plans, planner.cost, switch), 0.0)


def train(rank: int, world: int, s: TrainerSettings, plans: list[Schedule], deferred: dict[int, str]) -> dict:
    """`deferred`: the steps whose weight gradients wait (zero-bubble W's, `zero_bubble`'s pattern per step)."""
    env = init_distributed("cpu")
    docs = corpus(s.model.vocab)
    smp = sampler(docs)
    chosen = zero_bubble(deferred)
    slots_used: list[tuple[int, tuple[int, ...]]] = []  # (step, slots) of every phase on this rank

    def recorded(plan: IterationPlan, replica: int, stage: int) -> tuple[int, ...]:
        slots_used.append((plan.step, chosen(plan, replica, stage)))
        return slots_used[-1][1]

    trainer = Trainer(settings=s, corpus=TokenDocuments(docs), sampler=smp, env=env, weight_slots=recorded)
    metrics = [trainer.run_schedule(smp.next_batch(), plan) for plan in plans]
    metrics += [trainer.step() for _ in range(2)]
    # The measured comparison runs real iterations mid-run: training must go on as if it had not.
    comparison = trainer.compare(repeats=1)
    metrics += [trainer.step() for _ in range(STEPS - len(metrics))]
    trainer.close()
    opt = trainer.optimizer
    traffic = {str(d): opt.exchange_plan(d, s.parallel.sequence_parallel).traffic() for d in s.parallel.pool}
    splits = {
        str(d): {
            "gather_recv": sum(opt.exchange_plan(d, s.parallel.sequence_parallel).gather_recv_splits),
            "gather_send": sum(opt.exchange_plan(d, s.parallel.sequence_parallel).gather_send_splits),
            "reduce_send": sum(opt.exchange_plan(d, s.parallel.sequence_parallel).reduce_send_splits),
            "reduce_recv": sum(opt.exchange_plan(d, s.parallel.sequence_parallel).reduce_recv_splits),
        }
        for d in s.parallel.pool
    }
    return {
        "metrics": [m.to_dict() for m in metrics],
        "comparison": comparison.to_dict() if comparison is not None else None,
        "master": opt.master.clone(),
        "traffic": traffic,
        "splits": splits,
        "owned": trainer.optimizer.layout.owned_ranges(rank),
        "slots_used": slots_used,
    }


def reference(
    s: TrainerSettings,
    docs: list[np.ndarray] | None = None,
    smp: TokenBudgetSampler | None = None,
    norms: list[float] | None = None,
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, the full model, one document at a time, torch.optim.AdamW and clip_grad_norm_.

    `norms`, where given, receives each step's gradient norm before clipping (clip_grad_norm_'s).
    """
    spec = s.model
    docs = corpus(spec.vocab) if docs is None else docs
    smp = sampler(docs) if smp is None else smp
    model = StageModel(spec)
    model.load_full_state_dict(ShardLayout(spec, 1).full_state_dict(s.train.seed))
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    a = s.optim.adamw
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": a.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=s.optim.lr,
        betas=a.betas,
        eps=a.eps,
        foreach=False,
    )
    losses = []
    for step in range(s.train.steps):
        batch = smp.next_batch()
        total = count_targets(batch.lengths)
        loss = torch.zeros(())
        for d, start, n in zip(batch.docs, batch.starts, batch.lengths, strict=True):
            tokens = torch.from_numpy(docs[int(d)][int(start) : int(start + n)].astype(np.int64))
            packed = concatenate_documents([tokens])
            logits = model(packed.tokens, packed)
            loss = loss + F.cross_entropy(logits, packed.targets, ignore_index=IGNORE_INDEX, reduction="sum")
        loss = loss / total
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), a.grad_clip)
        if norms is not None:
            norms.append(float(norm))
        for group in opt.param_groups:
            group["lr"] = s.optim.lr_at(step, s.train.steps)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}
