"""Memory policies per micro-batch: what a micro-batch keeps for backward, and what recomputing the rest costs.

- none: every block keeps its activations (activations.layer_bytes);
- selective: each block's MLP (its RMSNorm, SwiGLU and w2) is checkpointed: the block keeps the MLP's
  input instead of the norm's tensors and SwiGLU's three ffn-wide projections, the largest of its
  activations, and backward runs the MLP's forward again (runtime/modeling/model.py's Block);
- full: each block is checkpointed: it keeps its input, and backward runs its whole forward again.

The planner chooses one per micro-batch (docs/design.md, section 4.3): the lightest whose cap holds it.
`FULL` is 1 and `NONE` 0, so a `recompute` flag reads as a policy. What a micro-batch runs: `CostModel.policy_run`.
"""

from __future__ import annotations

from enum import IntEnum

from hydraulis.errors import HydraulisError
from hydraulis.specs import ModelSpec


class MemoryPolicy(IntEnum):
    NONE = 0
    FULL = 1
    SELECTIVE = 2

    @property
    def label(self) -> str:
        return self.name.lower()

    @classmethod
    def parse(cls, name: str, where: str) -> MemoryPolicy:
        try:
            return cls[name.upper()]
        except KeyError:
            known = ", ".join(p.label for p in LIGHTEST_FIRST)
            raise HydraulisError(f"{where}: unknown memory policy {name!r}; use one of {known}") from None


LIGHTEST_FIRST = (MemoryPolicy.NONE, MemoryPolicy.SELECTIVE, MemoryPolicy.FULL)
RECOMPUTE_TIME = 4 / 3  # a training step is 4 forwards instead of 3 when each block's forward runs twice


def derived_scales(model: ModelSpec) -> dict[MemoryPolicy, tuple[float, float]]:
    """Each policy's (a, b) factors on a config's coefficients, from FLOPs: full recompute runs every forward
    again (a and b x 4/3); selective the MLP's GEMMs (3 x hidden x ffn per token and layer) again, a third of
    their training FLOPs, against b's per-token work (the layers' and the head's GEMMs); a is attention's."""
    layers = model.layers * model.params_per_layer + model.hidden * model.vocab_rows
    mlp = model.layers * 3 * model.hidden * model.ffn
    return {
        MemoryPolicy.NONE: (1.0, 1.0),
        MemoryPolicy.SELECTIVE: (1.0, 1.0 + mlp / (3 * layers)),
        MemoryPolicy.FULL: (RECOMPUTE_TIME, RECOMPUTE_TIME),
    }
