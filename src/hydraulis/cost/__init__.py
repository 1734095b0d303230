"""Cost models: the time of a micro-batch, the memory cap, the busy threshold."""

from __future__ import annotations

from pathlib import Path

from hydraulis.cost.analytic import AnalyticCostModel
from hydraulis.cost.context_parallel import CP_SUFFIX, extend_to_cp
from hydraulis.cost.memory import CAP_GRANULARITY, MemoryModel
from hydraulis.cost.model import Coefficients, CostModel
from hydraulis.cost.profiled import PRESETS, ProfiledCostModel
from hydraulis.errors import HydraulisError
from hydraulis.specs import DEVICES, MODELS, get_device, get_model

__all__ = [
    "AnalyticCostModel",
    "CAP_GRANULARITY",
    "Coefficients",
    "CostModel",
    "MemoryModel",
    "extend_to_cp",
    "PRESETS",
    "ProfiledCostModel",
    "load_cost_model",
]


def load_cost_model(name: str) -> CostModel:
    """A profile file, a profiled preset (`llama-7b@a800-80g`), or `MODEL@DEVICE` analytic.

    A `+cp` suffix (`llama-7b@a800-80g+cp`) adds CP configs derived analytically from the cp = 1 entries.
    """
    if name.endswith(CP_SUFFIX) and len(name) > len(CP_SUFFIX):
        return extend_to_cp(load_cost_model(name[: -len(CP_SUFFIX)]))
    if name in PRESETS:
        return ProfiledCostModel.preset(name)
    if name.endswith(".json") or Path(name).is_file():
        return ProfiledCostModel.from_file(name)
    if "@" in name:
        model, _, device = name.partition("@")
        return AnalyticCostModel(get_model(model), get_device(device))
    raise HydraulisError(
        f"unknown profile {name!r}: give a profile file, a preset ({', '.join(PRESETS)}) "
        f"or MODEL@DEVICE for the analytic model, each optionally with {CP_SUFFIX} "
        f"(models: {', '.join(MODELS)}; devices: {', '.join(DEVICES)})"
    )
