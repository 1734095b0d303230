"""The optimizer's settings: AdamW and the learning-rate schedule (plain records, no torch).

The run config's [optim] section builds them (config.OptimSection.settings)
and takes its defaults from them, so each default is written once;
runtime/optimizer/sharded.py steps AdamW with them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from hydraulis.errors import HydraulisError

LR_SCHEDULES = ("cosine", "linear", "constant")


@dataclass(frozen=True)
class AdamWSettings:
    """AdamW settings (decoupled weight decay, as torch.optim.AdamW)."""

    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    grad_clip: float = 1.0  # max global norm; 0 turns clipping off

    def __post_init__(self) -> None:
        b1, b2 = self.betas
        if not (0 <= b1 < 1 and 0 <= b2 < 1):
            raise HydraulisError(f"betas must lie in [0, 1), got {self.betas}")
        if self.eps <= 0 or self.weight_decay < 0 or self.grad_clip < 0:
            raise HydraulisError("eps must be positive; weight_decay and grad_clip non-negative")


@dataclass(frozen=True)
class OptimSettings:
    """The learning rate over the steps, and AdamW's settings."""

    lr: float = 3e-4
    warmup: int = 10
    schedule: str = "cosine"
    min_lr_ratio: float = 0.1  # the schedule decays to lr * min_lr_ratio at the last step
    adamw: AdamWSettings = field(default_factory=AdamWSettings)

    def __post_init__(self) -> None:
        if self.schedule not in LR_SCHEDULES:
            raise HydraulisError(f"unknown LR schedule {self.schedule!r}; use one of {', '.join(LR_SCHEDULES)}")
        if self.lr <= 0 or self.warmup < 0 or not 0 <= self.min_lr_ratio <= 1:
            raise HydraulisError("lr must be positive, warmup non-negative, min_lr_ratio within [0, 1]")

    def lr_schedule_state(self, total_steps: int) -> dict[str, object]:
        """What the LR at each step depends on; a checkpoint records it, a resume compares it."""
        return {
            "lr": self.lr,
            "warmup": self.warmup,
            "schedule": self.schedule,
            "min_lr_ratio": self.min_lr_ratio,
            "total_steps": total_steps,
        }

    def lr_at(self, step: int, total_steps: int) -> float:
        """Linear warm-up over `warmup` steps, then the schedule down to lr * min_lr_ratio."""
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        if self.schedule == "constant":
            return self.lr
        progress = min(1.0, (step - self.warmup) / max(1, total_steps - 1 - self.warmup))
        floor = self.lr * self.min_lr_ratio
        if self.schedule == "linear":
            return self.lr - (self.lr - floor) * progress
        return floor + (self.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))
