"""Parallel configs, replicas and deployments, and their placement on devices.

A deployment splits the cluster into replicas; each replica computes with one
ParallelConfig. Placement follows the hardware: a TP (x CP) group never
crosses a node, a group larger than a node takes whole nodes, and pipeline
stages may sit on different nodes.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from hydraulis.errors import HydraulisError
from hydraulis.jsonio import Fields
from hydraulis.limits import MAX_GPUS
from hydraulis.specs import ClusterSpec, ModelSpec


@dataclass(frozen=True, order=True)
class ParallelConfig:
    tp: int = 1
    pp: int = 1
    cp: int = 1

    def __post_init__(self) -> None:
        for field in ("tp", "pp", "cp"):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 1:
                raise HydraulisError(f"parallel config: {field} must be a positive integer, got {value!r}")

    @property
    def num_gpus(self) -> int:
        return self.tp * self.pp * self.cp

    @property
    def group_size(self) -> int:
        """GPUs of one pipeline stage: they must share a node (or take whole nodes)."""
        return self.tp * self.cp

    @property
    def name(self) -> str:
        return f"tp{self.tp}pp{self.pp}" + (f"cp{self.cp}" if self.cp > 1 else "")

    def __str__(self) -> str:
        return self.name

    def compact(self) -> str:
        return f"(tp{self.tp},pp{self.pp}" + (f",cp{self.cp})" if self.cp > 1 else ")")

    _PATTERN = re.compile(r"^\(?\s*tp\s*(\d+)\s*,?\s*pp\s*(\d+)\s*(?:,?\s*cp\s*(\d+))?\s*\)?$")

    @classmethod
    def parse(cls, text: str) -> ParallelConfig:
        """Accepts `tp2pp1`, `tp2,pp1`, `(tp2,pp1,cp2)`."""
        match = cls._PATTERN.match(text.strip().lower())
        if not match:
            raise HydraulisError(f"cannot parse parallel config {text!r}; write it like 'tp2pp1' or '(tp2,pp1)'")
        tp, pp, cp = match.groups()
        return cls(int(tp), int(pp), int(cp or 1))

    @classmethod
    def from_fields(cls, f: Fields) -> ParallelConfig:
        """A config from a JSON row's `tp`, `pp` and `cp` (default 1) fields."""
        return cls(
            f.int("tp", minimum=1, maximum=MAX_GPUS),
            f.int("pp", minimum=1, maximum=MAX_GPUS),
            f.int("cp", default=1, minimum=1, maximum=MAX_GPUS),
        )

    def validate(self, model: ModelSpec) -> None:
        if model.layers % self.pp:
            raise HydraulisError(f"{self.name}: {model.name} has {model.layers} layers, not divisible by pp={self.pp}")
        if model.heads % self.tp:
            raise HydraulisError(f"{self.name}: {model.name} has {model.heads} heads, not divisible by tp={self.tp}")
        if model.kv_heads % self.tp and self.tp % model.kv_heads:
            raise HydraulisError(
                f"{self.name}: {model.name} has {model.kv_heads} KV heads; tp={self.tp} must divide "
                "them or be a multiple of them"
            )


@dataclass(frozen=True)
class Replica:
    """One model copy: its config and its global device ids, stage-major."""

    config: ParallelConfig
    devices: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.devices) != self.config.num_gpus:
            raise HydraulisError(
                f"replica {self.config.name} needs {self.config.num_gpus} devices, got {len(self.devices)}"
            )

    def stage_devices(self, stage: int) -> tuple[int, ...]:
        g = self.config.group_size
        return self.devices[stage * g : (stage + 1) * g]


@dataclass(frozen=True)
class Deployment:
    """The replicas of one iteration; their devices are disjoint and cover the cluster."""

    replicas: tuple[Replica, ...]

    @property
    def num_gpus(self) -> int:
        return sum(r.config.num_gpus for r in self.replicas)

    @property
    def configs(self) -> tuple[ParallelConfig, ...]:
        return tuple(r.config for r in self.replicas)

    @property
    def is_homogeneous(self) -> bool:
        return len(set(self.configs)) == 1

    def __str__(self) -> str:
        return format_configs(self.configs)

    def __len__(self) -> int:
        return len(self.replicas)

    @classmethod
    def place(cls, configs: Sequence[ParallelConfig], cluster: ClusterSpec) -> Deployment:
        """Give each replica devices; replicas keep the order of `configs`."""
        total = sum(c.num_gpus for c in configs)
        if not configs:
            raise HydraulisError("a deployment needs at least one replica")
        if total != cluster.num_gpus:
            raise HydraulisError(
                f"deployment {format_configs(configs)} uses {total} GPUs but the cluster has {cluster.num_gpus}"
            )
        gpn = cluster.gpus_per_node
        free = [list(range(n * gpn, min((n + 1) * gpn, cluster.num_gpus))) for n in range(cluster.num_nodes)]
        devices: dict[int, list[int]] = {}
        # Largest groups first keeps nodes unfragmented (first-fit decreasing).
        for index in sorted(range(len(configs)), key=lambda i: -configs[i].group_size):
            config = configs[index]
            g = config.group_size
            placed: list[int] = []
            for _ in range(config.pp):
                if g >= gpn:
                    if g % gpn:
                        raise HydraulisError(
                            f"{config.name}: a group of {g} GPUs is larger than a node of {gpn} "
                            f"but not a multiple of it; use tp*cp that divides {gpn} or is a multiple of it"
                        )
                    nodes = [n for n, f in enumerate(free) if len(f) == gpn][: g // gpn]
                    if len(nodes) < g // gpn:
                        raise HydraulisError(
                            f"cannot place {format_configs(configs)}: {config.name} needs {g // gpn} "
                            "whole free nodes per stage"
                        )
                    for n in nodes:
                        placed += free[n]
                        free[n] = []
                else:
                    node = next((n for n, f in enumerate(free) if len(f) >= g), None)
                    if node is None:
                        raise HydraulisError(
                            f"cannot place {format_configs(configs)}: no node has {g} free GPUs for a "
                            f"{config.name} stage (a TP group never crosses a node)"
                        )
                    placed += free[node][:g]
                    free[node] = free[node][g:]
            devices[index] = placed
        return cls(tuple(Replica(c, tuple(devices[i])) for i, c in enumerate(configs)))

    @classmethod
    def from_devices(
        cls, configs: Sequence[ParallelConfig], devices: Sequence[Sequence[int]], cluster: ClusterSpec
    ) -> Deployment:
        """A deployment with devices given explicitly (as in a plan file), checked."""
        if len(configs) != len(devices):
            raise HydraulisError(f"{len(configs)} replicas but {len(devices)} device lists")
        deployment = cls(tuple(Replica(c, tuple(int(d) for d in ds)) for c, ds in zip(configs, devices, strict=True)))
        deployment.validate(cluster)
        return deployment

    @classmethod
    def parse(cls, text: str, cluster: ClusterSpec) -> Deployment:
        return cls.place(parse_configs(text), cluster)

    def to_rows(self) -> list[dict[str, Any]]:
        """The JSON form of plan and pool files: one {tp, pp, cp, devices} row per replica."""
        return [
            {"tp": r.config.tp, "pp": r.config.pp, "cp": r.config.cp, "devices": list(r.devices)} for r in self.replicas
        ]

    @classmethod
    def from_rows(cls, rows: Any, cluster: ClusterSpec, where: str) -> Deployment:
        """Read `to_rows` rows (a JSON list at `where`), devices checked against the cluster."""
        if not isinstance(rows, list):
            raise HydraulisError(f"{where}: expected a list, got {type(rows).__name__}")
        configs, devices = [], []
        for i, row in enumerate(rows):
            r = Fields(row, f"{where}[{i}]")
            configs.append(ParallelConfig.from_fields(r))
            devices.append(r.int_list("devices", minimum=0, maximum=MAX_GPUS))
        try:
            return cls.from_devices(configs, devices, cluster)
        except HydraulisError as exc:
            raise HydraulisError(f"{where}: {exc}") from None

    def validate(self, cluster: ClusterSpec, model: ModelSpec | None = None) -> None:
        if self.num_gpus != cluster.num_gpus:
            raise HydraulisError(f"deployment {self} uses {self.num_gpus} GPUs but the cluster has {cluster.num_gpus}")
        seen: set[int] = set()
        gpn = cluster.gpus_per_node
        for replica in self.replicas:
            for d in replica.devices:
                if not 0 <= d < cluster.num_gpus:
                    raise HydraulisError(f"deployment {self}: device {d} is outside 0..{cluster.num_gpus - 1}")
                if d in seen:
                    raise HydraulisError(f"deployment {self}: device {d} is used by two replicas")
                seen.add(d)
            for s in range(replica.config.pp):
                nodes = {d // gpn for d in replica.stage_devices(s)}
                g = replica.config.group_size
                if len(nodes) > max(1, g // gpn):
                    raise HydraulisError(
                        f"deployment {self}: a {replica.config.name} TP group spans nodes {sorted(nodes)}"
                    )
            if model is not None:
                replica.config.validate(model)


_ITEM = re.compile(r"^(?:(\d+)\s*[x*]\s*)?(\(?\s*tp\s*\d+.*)$")


def parse_configs(text: str) -> list[ParallelConfig]:
    """`1x(tp8,pp1) + 6x(tp2,pp2)` -> [tp8pp1, tp2pp2 x 6]."""
    configs: list[ParallelConfig] = []
    for item in text.lower().split("+"):
        match = _ITEM.match(item.strip())
        if not match:
            raise HydraulisError(
                f"cannot parse deployment item {item.strip()!r} in {text!r}; write e.g. '1x(tp8,pp1) + 6x(tp2,pp2)'"
            )
        count = int(match.group(1) or 1)
        if count < 1:
            raise HydraulisError(f"deployment {text!r}: replica count must be positive")
        configs += [ParallelConfig.parse(match.group(2))] * count
    return configs


def format_configs(configs: Iterable[ParallelConfig]) -> str:
    """Compact text: runs of equal configs as `Nx(tpT,ppP)`."""
    parts: list[str] = []
    last: ParallelConfig | None = None
    count = 0
    for config in configs:
        if config == last:
            count += 1
            continue
        if last is not None:
            parts.append(f"{count}x{last.compact()}")
        last, count = config, 1
    if last is not None:
        parts.append(f"{count}x{last.compact()}")
    return " + ".join(parts)
