"""Each rank's torch, numpy and python RNG states as JSON (no pickle in a checkpoint)."""

from __future__ import annotations

import base64
import random
from typing import Any

import numpy as np
import torch

from hydraulis.errors import HydraulisError


def rng_state(device: torch.device) -> dict[str, Any]:
    """This process's torch, numpy and python RNG states as JSON (no pickle in a checkpoint)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    version, state, gauss_next = random.getstate()
    out: dict[str, Any] = {
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
        "numpy": {
            "kind": kind,
            "keys": [int(k) for k in keys],
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "python": {"version": version, "state": list(state), "gauss_next": gauss_next},
    }
    if device.type == "cuda":
        out["cuda"] = base64.b64encode(torch.cuda.get_rng_state(device).numpy().tobytes()).decode()
    return out


def set_rng_state(data: dict[str, Any], device: torch.device, where: str) -> None:
    try:
        torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(data["torch"])), dtype=torch.uint8))
        n = data["numpy"]
        np.random.set_state(
            (n["kind"], np.array(n["keys"], dtype=np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"])
        )
        p = data["python"]
        random.setstate((p["version"], tuple(p["state"]), p["gauss_next"]))
        if device.type == "cuda" and "cuda" in data:
            state = torch.frombuffer(bytearray(base64.b64decode(data["cuda"])), dtype=torch.uint8)
            torch.cuda.set_rng_state(state, device)
    except (KeyError, TypeError, ValueError, RuntimeError) as exc:
        raise HydraulisError(f"{where}: not a valid RNG state ({type(exc).__name__}: {exc})") from None
