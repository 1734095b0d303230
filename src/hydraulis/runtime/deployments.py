"""The pool's deployments as one rank runs them: groups, stage models and exchange plans, built once.

`torch.distributed.new_group` is a collective of the whole job, so the
groups of EVERY deployment in the pool are built at start-up, on every rank,
in pool order; `build_replica_groups` caches them by rank list, so
deployments that share a replica share its groups. Each rank keeps one
`StageModel` per role it can take (a deployment's replica config, stage and
TP and CP rank; interleaved, all vp model chunks of its stage); only the
active deployment's model holds parameter storage, and a switch frees the
old one's and gathers the new one's from the optimizer's owners. Nothing of the optimizer moves.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch

from hydraulis.errors import HydraulisError
from hydraulis.parallel import Deployment
from hydraulis.runtime.modeling.main_grad import attach_main_grads, clear_grads, gradient
from hydraulis.runtime.modeling.model import StageModel
from hydraulis.runtime.optimizer.exchange import Exchange, ExchangeHooks, attach_exchange_hooks, gather
from hydraulis.runtime.optimizer.sharded import ExchangePlan, ShardedOptimizer
from hydraulis.runtime.parallelism.groups import DEFAULT_TIMEOUT, ReplicaGroups, build_replica_groups
from hydraulis.specs import ModelSpec


@dataclass
class RankDeployment:
    """This rank's part of one deployment (a `parallel.Deployment`): its replica, groups, model and exchange plan."""

    deployment: Deployment
    replica: int  # index of this rank's replica in the deployment
    groups: ReplicaGroups
    model: StageModel
    exchange_plan: ExchangePlan
    hooks: ExchangeHooks  # the model's exchange hooks (shared by the parts that share the model)

    @property
    def params(self) -> list[torch.nn.Parameter]:
        """The compute shard in the exchange plan's order."""
        named = dict(self.model.named_parameters())
        return [named[p.name] for p in self.exchange_plan.local]

    def exchanging(self, ex: Exchange) -> AbstractContextManager[Exchange]:
        """While the block runs, the model's hooks gather ahead of each layer and reduce behind backward into
        `ex`; after it (an error included) they do nothing."""
        return self.hooks.exchanging(ex)

    @property
    def grads(self) -> list[torch.Tensor | None]:
        """The compute shard's accumulated gradients in the exchange plan's order (under bf16 scaled fp16 sums:
        `grad_unscales` gives their factors, main_grad.py)."""
        return [gradient(p)[0] for p in self.params]

    @property
    def grad_unscales(self) -> list[torch.Tensor | None]:
        return [gradient(p)[1] for p in self.params]

    def clear_grads(self) -> None:
        clear_grads(self.model.parameters())


class BuiltDeployments:
    """Every deployment of the pool, ready to run on this rank; one of them active at a time."""

    def __init__(
        self,
        spec: ModelSpec,
        pool: Sequence[Deployment],
        optimizer: ShardedOptimizer,
        dtype: torch.dtype,
        device: torch.device,
        sequence_parallel: bool = False,
        timeout: datetime.timedelta = DEFAULT_TIMEOUT,
    ) -> None:
        self.pool = tuple(pool)
        self.optimizer = optimizer
        self.dtype = dtype
        self.device = device
        rank = optimizer.rank
        models: dict[tuple, tuple[StageModel, ExchangeHooks]] = {}
        self.parts: list[RankDeployment] = []
        for deployment in self.pool:
            groups = build_replica_groups(deployment.replicas, sequence_parallel, timeout)
            if groups is None:
                raise HydraulisError(f"deployment {deployment} gives rank {rank} no replica")
            replica = next(i for i, r in enumerate(deployment.replicas) if rank in r.devices)
            key = (groups.ranks, groups.config, groups.stage, groups.tp.rank, groups.cp.rank)
            if key not in models:
                g = groups.config
                model = StageModel(spec, groups.tp, groups.stage, g.pp, dtype=dtype, device=device, cp=groups.cp,
                                   vp=g.vp)  # the recompute set runs full by its micro-batches' policy
                release(model)
                if dtype != torch.float32:
                    attach_main_grads(model)  # sum micro-batches in scaled fp16 (main_grad.py)
                hooks = attach_exchange_hooks(model)  # after the main grads: a gradient is sent once it is complete
                models[key] = (model, hooks)
            model, hooks = models[key]
            plan = optimizer.exchange_plan(deployment, sequence_parallel)
            self.parts.append(RankDeployment(deployment=deployment, replica=replica, groups=groups, model=model,
                                             exchange_plan=plan, hooks=hooks))
        self.current: int | None = None

    def index(self, deployment: Deployment) -> int:
        """The deployment's position in the pool."""
        return self.pool.index(deployment)

    def activate(self, index: int) -> tuple[RankDeployment, bool]:
        """Make deployment `index` the one that computes; returns it and whether this was a switch."""
        part = self.parts[index]
        switched = self.current is not None and self.current != index
        if self.current is not None and self.parts[self.current].model is not part.model:
            release(self.parts[self.current].model)
        self.current = index
        allocate(part.model, self.dtype, self.device)
        return part, switched

    def gather(self, part: RankDeployment) -> None:
        """The compute shard's current values from the owners, all before compute (profiling, benchmarks)."""
        gather(self.optimizer, part.exchange_plan, part.params, self.dtype)

    def exchange(
        self, part: RankDeployment, micro_batches: int, reduce_dtype: torch.dtype, overlap: bool = True,
        accumulate: bool = False, reduce_after: int = 1,
    ) -> Exchange:
        """One iteration's (or phase's) gather and reduce, driven by the model's hooks while it computes (exchange.py).

        A pipelined replica gathers everything before its first micro-batch: waiting for a round inside
        forward could block a neighbour stage's p2p. Its reduce still goes out from backward. `accumulate`:
        the owners add to the gradient earlier phases of the iteration reduced instead of starting from zero.
        `reduce_after`: the stage's last blocks backward frees before the reduce's first round (cost/memory.py).
        """
        ex = Exchange(self.optimizer, part.exchange_plan, part.params, self.dtype, reduce_dtype=reduce_dtype,
                      micro_batches=micro_batches, enabled=overlap, accumulate=accumulate, reduce_after=reduce_after)
        if not overlap or part.groups.config.pp > 1:
            ex.gather_ahead()
        return ex


def release(model: StageModel) -> None:
    """Drop a model's parameter and gradient storage, keeping the modules (and their shard specs)."""
    clear_grads(model.parameters())
    for p in model.parameters():
        if p.numel():
            p.hydraulis_shape = tuple(p.shape)
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)


def allocate(model: StageModel, dtype: torch.dtype, device: torch.device) -> None:
    """Give a released model storage of its own shapes again (values come from the next gather)."""
    for p in model.parameters():
        shape = getattr(p, "hydraulis_shape", None)
        if shape is not None and p.numel() == 0:
            p.data = torch.empty(shape, dtype=dtype, device=device)
