"""Training variants on every rank (bucket sizes, dtypes): one run each on the same plans, the exchange measured."""

from __future__ import annotations

import dataclasses

import torch
from train_workers import corpus, cpu_settings, sampler, varied, weight_slots, zero_bubble

from hydraulis.pipeline_order import BACKWARD, stage_order, with_weights
from hydraulis.planner.oracles.zero_bubble import weight_grad_bytes
from hydraulis.planner.plan import IterationPlan
from hydraulis.runtime.parallelism import collectives, groups
from hydraulis.runtime.parallelism.batch import TokenDocuments
from hydraulis.runtime.parallelism.launch import init_distributed
from hydraulis.runtime.trainer import Trainer
from hydraulis.settings import TrainerSettings


def timeout_s(group) -> float:
    """The timeout a process group's gloo backend now has."""
    group = group or torch.distributed.distributed_c10d._get_default_group()
    return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()


def train_variants(
    rank: int, world: int, s: TrainerSettings, plans: list[IterationPlan], variants: list[dict]
) -> list[dict]:
    """The same switching steps once per variant of the settings: final owned master, losses, exchange peaks."""
    env = init_distributed("cpu")
    out = []
    for changes in variants:
        docs = corpus(s.model.vocab)
        smp = sampler(docs)
        trainer = Trainer(settings=varied(s, **changes), corpus=TokenDocuments(docs), sampler=smp, env=env)
        metrics, early, buffers = [], [], []
        for plan in plans:
            metrics.append(trainer.run_iteration(smp.next_batch(), plan))  # the first settles the timeouts
            ex = trainer.meter.runs[-1].exchange
            buffers.append(ex.buffer_bytes)
            early.append((ex.gather.early, ex.reduce.early, len(trainer.deployments.parts[
                trainer.settings.parallel.pool.index(plan.deployment)].exchange_plan.rounds)))
        trainer.close()
        plan_rounds = {str(d): len(trainer.optimizer.exchange_plan(d, s.parallel.sequence_parallel).rounds)
                       for d in s.parallel.pool}
        out.append({
            "master": trainer.optimizer.master.clone(),
            "losses": [m.loss for m in metrics],
            "grad_norms": [m.grad_norm for m in metrics],
            "measured_peak": max(m.exchange_peak_bytes for m in metrics if m.exchange_peak_bytes is not None),
            "buffer_peak": max(buffers),  # what the exchanges report their buffers held
            "rounds": plan_rounds,
            "early": early,  # per step: gather rounds issued from forward, reduce rounds from backward, rounds
            "exposed": [(m.exchange_exposed_min_s, m.exchange_exposed_s) for m in metrics],
            "groups": sorted(k for k, g in groups._GROUPS.items() if g is not None),
            "timeouts": sorted({timeout_s(g) for g in [None, *groups.built_groups()]}),
            "late_waits": collectives.late_waits,  # so far in this process: the exchange's waits for gloo's worker
        })
    torch.distributed.barrier()
    return out


def deferral_bytes(trainer: Trainer, pattern: str) -> float:
    """What deferring this rank's weight gradients by `pattern` (train_workers.weight_slots) adds to its peak in
    the zero-bubble oracle's accounting, in the runtime's fp32: each chunk's activations (the memory model's
    count of one more in flight) from its forward to its B, then its W's bytes (`weight_grad_bytes`: the linears'
    inputs and output gradients) until its W. The more of two differences to the fused backward (each W right
    after its B, none kept): the most held at any point, and on the first stage the most held at the end of a
    B of the embedding's chunk, beside the embedding's dense gradient (that stage's peak, `test_memory`)."""
    run = trainer.meter.runs[-1]
    plan, groups, cost, spec = run.plan, run.part.groups, trainer.settings.parallel.cost, trainer.settings.model
    config, lengths = groups.config, [int(s.sum()) for s in run.plan.micro_batch_lengths(run.part.replica)]
    memory = dataclasses.replace(cost.memory, sequence_parallel=groups.tp.sequence_parallel)
    policies = [cost.policy_run(config, plan.policy(run.part.replica, k)) for k in range(len(lengths))]
    held = [memory.activation_bytes(config, spec, n, recompute=p, held=2, dtype_bytes=4)
            - memory.activation_bytes(config, spec, n, recompute=p, held=1, dtype_bytes=4)
            for n, p in zip(lengths, policies, strict=True)]
    weight = [n * spec.layers // (config.pp * config.vp) * weight_grad_bytes(spec, config.tp, 4) for n in lengths]
    order = stage_order(config.pp, config.vp, len(lengths), groups.stage)

    def most_held(slots: tuple[int, ...], fused: bool) -> tuple[float, float]:
        """The most held, and the most held at the end of an embedding's B (less its W's bytes when `fused`)."""
        now = peak = after_backward = 0.0
        for kind, j, chunk in with_weights(order, slots):
            now += (held[j], weight[j] - held[j], -weight[j])[kind]
            peak = max(peak, now)
            if kind == BACKWARD and groups.stage == chunk == 0:
                after_backward = max(after_backward, now - weight[j] if fused else now)
        return peak, after_backward

    args = (config.pp, config.vp, len(lengths), groups.stage)
    deferred, fused = most_held(weight_slots(*args, pattern), False), most_held(weight_slots(*args, "fused"), True)
    return max(deferred[0] - fused[0], deferred[1] - fused[1])


def train_small(rank: int, world: int, steps: int, bucket_bytes: int, pipelines: tuple[str, ...] = ()) -> dict:
    """Model `small` on `4x(tp1,pp1)` in fp32, planned by the trainer: each step's metrics; then the same on each
    of `pipelines` (a pool of one deployment each; "POOL PATTERN": its weight gradients deferred by that pattern,
    train_workers.weight_slots) for `steps` steps: this rank's stage, its measured and predicted peaks per step,
    and what deferral adds to the prediction (`deferral_bytes`)."""
    import gc

    from hydraulis.data.sampler import TokenBudgetSampler
    from hydraulis.optim import OptimSettings
    from hydraulis.specs import MODELS

    env = init_distributed("cpu")
    out: dict = {"pipelines": {}}
    for name in ("4x(tp1,pp1)", *pipelines):
        pool, _, pattern = name.partition(" ")
        docs = corpus(MODELS["small"].vocab)
        smp = TokenBudgetSampler([len(d) for d in docs], tokens_per_batch=2048, max_len=160, seed=1)
        s = cpu_settings(
            world, [pool], OptimSettings(lr=1e-3, warmup=1), steps, "small", exchange_bucket_bytes=bucket_bytes,
            memory_every=1,  # every step measured, not the CPU default's sample
        )
        trainer = Trainer(settings=s, corpus=TokenDocuments(docs), sampler=smp, env=env,
                          weight_slots=zero_bubble(pattern) if pattern else None)
        metrics, figures = [], []
        for _ in range(steps):
            metrics.append(trainer.step().to_dict())
            mine = trainer.meter.mine
            figures.append((trainer.meter.runs[-1].part.groups.stage, mine.memory_peak, mine.memory_predicted,
                            deferral_bytes(trainer, pattern) if pattern else 0.0))
        trainer.close()
        del trainer
        gc.collect()  # the next pool's census finds none of this one's tensors
        if name == "4x(tp1,pp1)":
            out["metrics"] = metrics
        else:
            out["pipelines"][name] = figures
    return out
