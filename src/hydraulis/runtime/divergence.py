"""The divergence guard: a step whose loss or gradient norm is not finite changes no weights.

The loss sum and the squared gradient norm are all-reduced in one collective
(`ShardedOptimizer.global_norm`), so every rank sees the same two
numbers and takes the same decision without another collective. After
`[train] max_bad_steps` skipped steps in one invocation, `DivergenceGuard`
stops the run with one line naming the step; the last checkpoint saved
before stays the newest.

`HYDRAULIS_TEST_NAN_STEP=K` is a test hook: at step K the first micro-batch
of the last pipeline stage gets NaN final hidden states (the head's input),
so its logits, its loss and every gradient it reaches are NaN, as a real
divergence would be.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from hydraulis.errors import HydraulisError

POISON_ENV = "HYDRAULIS_TEST_NAN_STEP"


def finite(loss_sum: float, grad_norm: float) -> bool:
    """Whether a step may update the weights."""
    return math.isfinite(loss_sum) and math.isfinite(grad_norm)


@contextmanager
def poisoned(model: torch.nn.Module, step: int, last_stage: bool) -> Iterator[None]:
    """The test hook (POISON_ENV): NaN final hidden states (so logits and loss) for the first micro-batch of this
    step on a last stage; the loss head (runtime/modeling/cross_entropy.py) takes them from the final norm."""
    wanted = os.environ.get(POISON_ENV)
    if not last_stage or wanted is None or not wanted.isdigit() or int(wanted) != step:
        yield
        return

    def hook(module: torch.nn.Module, args: object, output: torch.Tensor) -> torch.Tensor:
        handle.remove()  # one micro-batch only
        return output * float("nan")

    handle = model.norm.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


@dataclass
class DivergenceGuard:
    """Counts skipped steps; the `limit`-th one stops the run (every rank raises the same line)."""

    limit: int
    skipped: list[int] = field(default_factory=list)

    def check(self, step: int, loss: float, grad_norm: float, skipped: bool) -> str | None:
        """One line for a skipped step (None for a good one); raises at the limit."""
        if not skipped:
            return None
        self.skipped.append(step)
        if len(self.skipped) >= self.limit:
            raise HydraulisError(
                f"training diverged: step {step} is the {len(self.skipped)}th with a non-finite loss or gradient "
                f"norm (steps {', '.join(map(str, self.skipped))}; [train] max_bad_steps = {self.limit}); "
                "the last checkpoint saved before is kept: lower [optim] lr or check the data, then --resume"
            )
        return f"step {step}: loss {loss} or gradient norm {grad_norm} is not finite; skipped the optimizer step"
