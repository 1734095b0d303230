"""A measured profile: every rank's timings from runtime/metering/profiler.py assembled into `hydraulis.profile/1` data.

Per config: the slowest stage, the median over repeats and then over
replicas; a robust fit of a, b, c (cost/fit.py), a third of the points held
out of a second fit for the fidelity; activation and state bytes for the
memory model; the links and the optimizer phase. profiled.py reads the
result. No torch: the measurements arrive as plain numbers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from hydraulis.cost.conditions import Conditions, disturbed
from hydraulis.cost.fit import FitResult, fidelity, fit_link, fit_robust, holdout_fidelity
from hydraulis.cost.memory import CAP_GRANULARITY
from hydraulis.cost.profiled import PROFILE_SCHEMA
from hydraulis.cost.shards import TrainingState
from hydraulis.cost.sweep import ProfileSettings, sweep
from hydraulis.parallel import ParallelConfig, Replica
from hydraulis.specs import GiB, ModelSpec

CPU_MEMORY_METHOD = (
    "cpu: counted tensor bytes (parameters and gradients as static; tensors saved by autograd for backward, "
    "via torch.autograd.graph.saved_tensors_hooks, as activations), not an allocator's peak"
)
CUDA_MEMORY_METHOD = "cuda: torch.cuda.max_memory_allocated over one forward+backward, minus memory_allocated before"


def filling_replicas(config: ParallelConfig, world: int) -> tuple[Replica, ...]:
    """Replicas of `config` on consecutive ranks, as many as fill the job."""
    n = config.num_gpus
    return tuple(Replica(config, tuple(range(j * n, (j + 1) * n))) for j in range(world // n))


def _point_times(config: ParallelConfig, ranks: Sequence[dict[str, Any]], world: int) -> tuple[list, list]:
    """Per point: the config's time (slowest stage, median over repeats, then replicas) and per-stage times."""
    per_rank = {
        r["rank"]: np.asarray(r["configs"][config.name]["times_s"]) for r in ranks if config.name in r["configs"]
    }  # [points, repeats]
    points = next(iter(per_rank.values())).shape[0]
    replica_times, replica_stages = [], []
    for replica in filling_replicas(config, world):  # the replicas `measure` ran, on the same ranks
        if any(m not in per_rank for m in replica.devices):
            continue  # a replica that waited while the CPU's cores were taken
        # per stage and repeat, its slowest TP (and CP) rank
        stages = [np.max([per_rank[m] for m in replica.stage_devices(s)], axis=0) for s in range(config.pp)]
        stages_arr = np.stack(stages)  # [stage, point, repeat]
        replica_times.append(np.median(stages_arr.max(axis=0), axis=1))
        replica_stages.append(np.median(stages_arr, axis=2))
    times = np.median(np.stack(replica_times), axis=0)
    stage_times = np.median(np.stack(replica_stages), axis=0)  # [stage, point]
    return [float(t) for t in times], [[float(stage_times[s, i]) for s in range(config.pp)] for i in range(points)]


def _link(rows: Sequence[Sequence[dict[str, Any]]]) -> dict[str, Any] | None:
    """Per size: slowest rank per repeat, median over repeats; then latency and bandwidth."""
    rows = [r for r in rows if r]
    if not rows:
        return None
    sizes = [row["bytes"] for row in rows[0]]
    times = []
    for i in range(len(sizes)):
        per_repeat = np.max([np.asarray(r[i]["times_s"]) for r in rows], axis=0)
        times.append(float(np.median(per_repeat)))
    latency, bandwidth = fit_link(sizes, times)
    return {
        "latency_s": latency,
        "bandwidth_Bps": bandwidth,
        "points": [{"bytes": int(b), "time_s": t} for b, t in zip(sizes, times, strict=True)],
    }


def _time_row(config: ParallelConfig, fit: FitResult, held: dict[str, Any], busy: int | None) -> dict[str, Any]:
    """A config's `time_ms` row: the fitted coefficients (ms) and the held-out error."""
    co = fit.coefficients
    row = {
        "tp": config.tp,
        "pp": config.pp,
        **({"cp": config.cp} if config.cp > 1 else {}),
        "a": co.a * 1e3,
        "b": co.b * 1e3,
        "c": co.c * 1e3,
        "fit_loss": "soft_l1 on relative residuals, a, b, c >= 0",
        "holdout_median_abs_rel_error": held["median_abs_rel_error"],
        "holdout_worst_abs_rel_error": held["worst_abs_rel_error"],
    }
    if busy is not None:
        row["busy_ranks"] = busy
    return row


def _activation(spec: ModelSpec, config: ParallelConfig, rows: Sequence[dict[str, Any]], points: list) -> float:
    """The memory model's activation factor of a config: per stage, activation bytes per token (most over the
    points, the TP ranks, the replicas); 1F1B: stage s holds pp - s micro-batches at its peak."""
    per_stage = [0.0] * config.pp
    for row in rows:
        # per token the rank holds (its CP share), as the memory model's per-token bytes / cp assumes
        held_tokens = row.get("tokens") or [sum(p) for p in points]
        per_token = max(b / t for b, t in zip(row["activation_bytes"], held_tokens, strict=True))
        per_stage[row["stage"]] = max(per_stage[row["stage"]], per_token)
    peak_per_token = max((config.pp - s) * per_stage[s] for s in range(config.pp))
    return peak_per_token / (spec.layers * spec.hidden / config.tp)


def _memory(spec: ModelSpec, device: dict[str, Any], ranks: Sequence[dict[str, Any]],
            activation: dict[int, float], state_per_param: float) -> dict[str, Any]:
    """The profile's `memory`: measured activation factors and state, the device's margins."""
    held = TrainingState()
    state_total = state_per_param + held.sharded_bytes
    memory_bytes = int(device["memory_bytes"])
    is_cuda = device["kind"] == "cuda"
    return {
        "method": CUDA_MEMORY_METHOD if is_cuda else CPU_MEMORY_METHOD,
        "activation_bytes_per_token_hidden_layer": {str(tp): activation[tp] for tp in sorted(activation)},
        "state_bytes_per_hidden2_layer": state_total * spec.params_per_layer / (spec.hidden * spec.hidden),
        "optimizer_sharded_fraction": held.sharded_bytes / state_total,
        "embedding_state_bytes": state_total,
        "context_overhead_bytes": float(max(r["context_bytes"] for r in ranks)),
        "safety_margin_bytes": float(max(6 * GiB, 0.075 * memory_bytes) if is_cuda else 0.1 * memory_bytes),
        "measured_state_bytes_per_param": state_per_param,
    }


def _beside_compute(data: dict[str, Any], configs: Sequence[ParallelConfig], ranks: Sequence[dict[str, Any]]) -> None:
    """What the profile measured besides compute: the optimizer step, the links, the shared cores and load."""
    world = len(ranks)
    if all("optimizer_step_s" in r for r in ranks):
        # Per repeat the slowest rank (the collectives wait for it), then the median over repeats.
        def step_ms(part: str) -> dict[str, float]:
            return {
                c.name: float(np.median(np.max([r["optimizer_step_s"][c.name][part] for r in ranks], axis=0))) * 1e3
                for c in configs
            }

        data["optimizer_step"] = {
            "world_size": world, "ms": step_ms("total"), "gather_ms": step_ms("gather"), "reduce_ms": step_ms("reduce")
        }
    if ranks[0].get("cores") is not None:  # CPU ranks sharing cores (see SharedCores)
        data["shared_cores"] = {"cores": ranks[0]["cores"], "threads_per_rank": ranks[0]["threads"]}
        load = ranks[0].get("load")
        foreign = load["foreign_cores_median"] if load else None
        data["conditions"] = Conditions(world, ranks[0]["threads"], ranks[0]["cores"], foreign).to_json()
        if load:
            data["measurements"]["load"] = load
    if world > 1 and ranks[0]["collectives"] is not None:
        a2a = _link([r["collectives"]["all_to_all"] for r in ranks])
        p2p = _link([r["collectives"]["p2p"] for r in ranks])
        data["collectives"] = {"world_size": world, "all_to_all": a2a, "p2p": p2p}
        data["collectives"] = {k: v for k, v in data["collectives"].items() if v is not None}


def build_profile(
    spec: ModelSpec,
    configs: Sequence[ParallelConfig],
    settings: ProfileSettings,
    ranks: Sequence[dict[str, Any]],
    device: dict[str, Any],
    name: str | None = None,
) -> dict[str, Any]:
    """The `hydraulis.profile/1` data from every rank's `measure` result."""
    world = len(ranks)
    points = sweep(settings)
    shared = ranks[0].get("cores") is not None  # CPU ranks sharing cores (see SharedCores)
    time_rows, measurements, fits = [], [], {}
    activation: dict[int, float] = {}
    min_eff: dict[int, int] = {}
    state_per_param = 0.0
    for config in configs:
        times, stage_times = _point_times(config, ranks, world)
        fit = fit_robust(points, times)
        held = holdout_fidelity(points, times, settings.holdout_fraction, settings.seed)
        predicted = [t * (1 + r) for t, r in zip(times, fit.residuals, strict=True)]
        fits[config.name] = {"holdout": held, "fit": fidelity(predicted, times)}
        time_rows.append(_time_row(config, fit, held, ranks[0]["busy_ranks"][config.name] if shared else None))
        rows = [r["configs"][config.name] for r in ranks if config.name in r["configs"]]
        activation[config.tp] = max(activation.get(config.tp, 0.0), _activation(spec, config, rows, points))
        state_per_param = max([state_per_param, *(r["static_bytes"] / max(1, r["params"]) for r in rows)])
        # Fewest tokens for which per-token work outweighs the per-micro-batch overhead c.
        co = fit.coefficients
        tokens = max(points[-1]) if co.b <= 0 else co.c / co.b
        rounded = int(math.ceil(tokens / CAP_GRANULARITY) * CAP_GRANULARITY)
        min_eff[config.tp] = max(min_eff.get(config.tp, 0), min(rounded, max(sum(p) for p in points)))
        measurements += [
            {
                "config": config.name,
                "lengths": list(lengths),
                "time_ms": times[i] * 1e3,
                "stage_ms": [t * 1e3 for t in stage_times[i]],
                "fit_rel_residual": fit.residuals[i],
                "activation_bytes_per_token": max(r["activation_bytes"][i] for r in rows) / sum(lengths),
            }
            for i, lengths in enumerate(points)
        ]
    memory = _memory(spec, device, ranks, activation, state_per_param)
    data: dict[str, Any] = {
        "schema": PROFILE_SCHEMA,
        "name": name or f"{spec.name}@{device['name']}-measured",
        "source": (
            f"hydraulis profile on {device['description']}: {world} {device['backend']} process(es), "
            f"{device['dtype']}, torch {device.get('torch', 'unknown')}. "
            "Per stage forward+backward of one packed micro-batch (neighbouring stages faked for pp > 1), "
            "median of repeats, slowest stage; robust fit. " + memory["method"]
        ),
        "model": spec.to_dict(),
        "device": {k: device[k] for k in ("name", "memory_bytes", "gpus_per_node", "kind", "dtype", "description")},
        "time_ms": time_rows,
        "memory": memory,
        "min_efficient_tokens": {str(tp): v for tp, v in sorted(min_eff.items())},
        "fidelity": fits,
        "measurements": {"settings": settings.to_json(), "points": measurements, "world_size": world},
    }
    _beside_compute(data, configs, ranks)
    policies = {g.name: _policy_time(g, ranks, time_rows[k]["c"] / 1e3) for k, g in enumerate(configs)}
    if all(policies.values()):
        data["policy_time"] = policies
    return data


def _policy_time(config: ParallelConfig, ranks: Sequence[dict[str, Any]], c: float) -> dict[str, float]:
    """Each memory policy's factor on a and b (cost/policies.py): at the point timed under it, the slowest
    rank's median time less c over its plain median time less c; empty where not measured."""
    rows = [r["configs"][config.name] for r in ranks if config.name in r["configs"]]
    if not rows or any("policy_times_s" not in r for r in rows):
        return {}
    plain = max(float(np.median(r["times_s"][r["policy_point"]])) for r in rows)
    names = rows[0]["policy_times_s"]
    slowest = {name: max(float(np.median(r["policy_times_s"][name])) for r in rows) for name in names}
    return {name: max(1.0, (t - c) / max(plain - c, 1e-12)) for name, t in slowest.items()}


def summary_rows(data: dict[str, Any]) -> list[list[str]]:
    """One table row per config: coefficients and how well they predict held-out micro-batches."""
    rows = []
    for row in data["time_ms"]:
        config = ParallelConfig(row["tp"], row["pp"], row.get("cp", 1)).name
        fid = data["fidelity"][config]
        rows.append(
            [
                config,
                f"{row['a']:.3g}",
                f"{row['b']:.3g}",
                f"{row['c']:.3g}",
                f"{fid['fit']['median_abs_rel_error']:.1%}",
                f"{fid['holdout']['median_abs_rel_error']:.1%}",
                f"{fid['holdout']['worst_abs_rel_error']:.1%}",
            ]
        )
    return rows


def _load(data: dict[str, Any]) -> tuple[dict[str, Any], int] | None:
    """A CPU profile's record of other processes' load and the cores it ran on (None: not measured)."""
    load, cores = data.get("measurements", {}).get("load"), data.get("conditions", {}).get("cores")
    return (load, cores) if load and cores else None


def measured_under_load(data: dict[str, Any]) -> bool:
    """Whether other processes took enough of the cores to disturb a CPU profile's timings."""
    found = _load(data)
    return found is not None and disturbed(found[0]["foreign_cores_median"], found[1])


def others_load(data: dict[str, Any]) -> str | None:
    """How much of the cores other processes took while a CPU profile was measured (None: not measured)."""
    found = _load(data)
    if found is None:
        return None
    load, cores = found
    return (f"other processes took a median {load['foreign_cores_median']:.2f} (at most "
            f"{load['foreign_cores_max']:.2f}) of {cores} cores")


def load_line(data: dict[str, Any]) -> str | None:
    """What other processes' load did to a CPU profile, in one line (None: it was not measured)."""
    took = others_load(data)
    if took is None:
        return None
    load = data["measurements"]["load"]
    kept = load["disturbed_kept"]
    return (
        f"load: {took} over the timed rounds; {load['measured_again']} disturbed round(s) measured again"
        + (f", {kept} kept disturbed (the retries ran out)" if kept else "")
        + (": profile again on a quieter machine" if measured_under_load(data) else "")
    )
