"""Cost models: the time of a micro-batch, the memory cap, the busy threshold."""

from __future__ import annotations

import difflib
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
        try:
            return AnalyticCostModel(get_model(model), get_device(device))
        except HydraulisError as exc:  # a preset mistyped reads as MODEL@DEVICE: name the presets too
            raise HydraulisError(unknown_profile(name, str(exc))) from None
    raise HydraulisError(unknown_profile(name))


def unknown_profile(name: str, why: str = "") -> str:
    """What a profile name that is none: the closest preset, then every kind of profile there is."""
    close = difflib.get_close_matches(name, list(PRESETS), n=1)
    return (
        f"unknown profile {name!r}" + (f" ({why})" if why else "")
        + (f"; the closest preset is {close[0]!r}" if close else "")
        + f"; give a profile file, a preset ({', '.join(PRESETS)}) or MODEL@DEVICE for the analytic model, each "
        f"optionally with {CP_SUFFIX} (models: {', '.join(MODELS)}; devices: {', '.join(DEVICES)})"
    )
