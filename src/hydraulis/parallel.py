"""Parallel configs, replicas and deployments, and their placement on devices.

A deployment splits the cluster into replicas; each replica computes with one
ParallelConfig. Placement follows the hardware: a TP group never crosses a
node (a TP group larger than a node takes whole nodes), a CP group may span
nodes but is kept in one node where it fits, and pipeline stages may sit on
different nodes.

Device layout of a replica (the contract with the runtime): devices are
stage-major; within a stage of tp*cp devices, local index = cp_rank*tp + tp_rank.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from hydraulis.errors import HydraulisError
from hydraulis.files import Fields
from hydraulis.limits import MAX_GPUS
from hydraulis.specs import ClusterSpec, ModelSpec

MAX_VP, MIN_CHUNK_LAYERS = 8, 2  # the interleaving the published recipes run (`ParallelConfig.vp_choices`)
PLANNED_CHUNK_LAYERS = 1  # hydraulis's own, down to one layer a chunk (`ParallelConfig.planned_vp_choices`)


@dataclass(frozen=True, order=True)
class ParallelConfig:
    """tp x pp x cp GPUs; `vp` virtual stages (model chunks) per pipeline rank, run as interleaved 1F1B
    (planner/sim.py): 1, the plain 1F1B, is every config's default and what the runtime runs today."""

    tp: int = 1
    pp: int = 1
    cp: int = 1
    vp: int = 1

    def __post_init__(self) -> None:
        for field in ("tp", "pp", "cp", "vp"):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 1:
                raise HydraulisError(f"parallel config: {field} must be a positive integer, got {value!r}")
        if self.vp > 1 and self.pp == 1:
            raise HydraulisError(f"parallel config: vp={self.vp} needs a pipeline; use vp = 1 with pp = 1")

    @property
    def num_gpus(self) -> int:
        return self.tp * self.pp * self.cp

    @property
    def group_size(self) -> int:
        """GPUs of one pipeline stage: cp TP groups of tp GPUs each."""
        return self.tp * self.cp

    @property
    def base(self) -> ParallelConfig:
        """The same GPUs run without interleaving: what the cost model's coefficients and measurements are of."""
        return self if self.vp == 1 else ParallelConfig(self.tp, self.pp, self.cp)

    def interleaved(self, vp: int) -> ParallelConfig:
        """This config's GPUs with `vp` model chunks per pipeline rank."""
        return ParallelConfig(self.tp, self.pp, self.cp, vp)

    def vp_choices(self, model: ModelSpec) -> tuple[int, ...]:
        """The vp > 1 a user of interleaving runs here, largest first: above pp = 2, those of at most MAX_VP that
        cut each stage's layers into chunks of at least MIN_CHUNK_LAYERS (Megatron-LM's Llama-3 recipes: 70B
        PP8 VP5, 405B PP8 VP8; Megatron-Bridge's 70B PP4 VP5); none at pp <= 2 or where the layers do not split."""
        per_stage = model.layers // self.pp
        if self.pp <= 2 or model.layers % self.pp:
            return ()
        return tuple(v for v in range(MAX_VP, 1, -1) if per_stage % v == 0 and per_stage // v >= MIN_CHUNK_LAYERS)

    def planned_vp_choices(self, model: ModelSpec) -> tuple[int, ...]:
        """The vp > 1 hydraulis plans here: above pp = 2 (as `vp_choices`), the deepest, chunks of
        PLANNED_CHUNK_LAYERS. Its bubble, (pp - 1) / vp of its micro-batches, is the least; its cap is within a few
        percent of the recipes' vp (the warm-up holds about as many layers: 70B tp1pp8cp8 4,352 tokens at vp 10,
        4,480 at vp 5); the sends it adds (pp vp - 1 crossings each way) the simulator counts. Deeper than the
        recipes' chunks of 2 layers or more, which the baselines keep; it paid on the 70B, 32B and 7B scenarios
        (docs/results.md, h-vp). One choice, not every divisor: offered every divisor, long-70b-128g's plans used
        only the deepest, and each extra config costs the proposal and the planner."""
        per_stage = model.layers // self.pp
        vp = per_stage // PLANNED_CHUNK_LAYERS
        if self.pp <= 2 or model.layers % self.pp or per_stage % PLANNED_CHUNK_LAYERS or vp < 2:
            return ()
        return (vp,)

    def cp_spans_nodes(self, gpus_per_node: int) -> bool:
        """Whether a stage's CP group crosses nodes (placement keeps a stage that fits in one node)."""
        return self.cp > 1 and self.group_size > gpus_per_node

    @property
    def name(self) -> str:
        return f"tp{self.tp}pp{self.pp}" + (f"cp{self.cp}" if self.cp > 1 else "") + (
            f"vp{self.vp}" if self.vp > 1 else "")

    def __str__(self) -> str:
        return self.name

    def compact(self) -> str:
        return (f"(tp{self.tp},pp{self.pp}" + (f",cp{self.cp}" if self.cp > 1 else "")
                + (f",vp{self.vp}" if self.vp > 1 else "") + ")")

    _PATTERN = re.compile(r"tp\s*(\d+)\s*,?\s*pp\s*(\d+)\s*(?:,?\s*cp\s*(\d+))?\s*(?:,?\s*vp\s*(\d+))?")

    @classmethod
    def parse(cls, text: str) -> ParallelConfig:
        """Accepts `tp2pp1`, `tp2,pp1`, `(tp2,pp1,cp2)`, `(tp4,pp8,vp5)`: parentheses around the whole of it, or
        none."""
        body = text.strip().lower()
        if body.startswith("(") and body.endswith(")"):
            body = body[1:-1].strip()
        match = cls._PATTERN.fullmatch(body)
        if not match:
            raise HydraulisError(
                f"cannot parse parallel config {text.strip()!r}{_unbalanced(text)}; "
                "write it like 'tp2pp1' or '(tp2,pp1)'"
            )
        tp, pp, cp, vp = match.groups()
        return cls(int(tp), int(pp), int(cp or 1), int(vp or 1))

    @classmethod
    def from_fields(cls, f: Fields) -> ParallelConfig:
        """A config from a JSON row's `tp`, `pp`, `cp` and `vp` (default 1) fields."""
        return cls(
            f.int("tp", minimum=1, maximum=MAX_GPUS),
            f.int("pp", minimum=1, maximum=MAX_GPUS),
            f.int("cp", default=1, minimum=1, maximum=MAX_GPUS),
            f.int("vp", default=1, minimum=1, maximum=MAX_GPUS),
        )

    def row(self) -> dict[str, int]:
        """The JSON fields `from_fields` reads; `vp` only where it is not 1 (files of plain 1F1B stay as they were)."""
        return {"tp": self.tp, "pp": self.pp, "cp": self.cp, **({"vp": self.vp} if self.vp > 1 else {})}

    def validate(self, model: ModelSpec) -> None:
        if model.layers % self.pp:
            raise HydraulisError(f"{self.name}: {model.name} has {model.layers} layers, not divisible by pp={self.pp}")
        if model.layers % (self.pp * self.vp):
            raise HydraulisError(f"{self.name}: {model.name} has {model.layers} layers, not divisible into pp x vp = "
                                 f"{self.pp * self.vp} chunks; use a vp that divides {model.layers // self.pp}")
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

    def tp_group(self, stage: int, cp_rank: int) -> tuple[int, ...]:
        """The TP group of one CP rank of one stage (local index cp_rank*tp + tp_rank)."""
        tp = self.config.tp
        return self.stage_devices(stage)[cp_rank * tp : (cp_rank + 1) * tp]


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
        for index in sorted(range(len(configs)), key=lambda i: (-configs[i].group_size, -configs[i].tp)):
            config = configs[index]
            if config.cp > 1 and config.tp > gpn and config.tp % gpn:
                raise _placement_error(configs, config, gpn)
            placed: list[int] = []
            for _ in range(config.pp):
                # A stage in one node, or on whole nodes; else (CP only) each CP rank's TP group on its own.
                stage = _take(free, config.group_size, gpn)
                if stage is None and config.cp > 1:
                    groups = [_take(free, config.tp, gpn) for _ in range(config.cp)]
                    stage = None if any(g is None for g in groups) else [d for g in groups for d in g or ()]
                if stage is None:
                    raise _placement_error(configs, config, gpn)
                placed += stage
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
        return cls.place(parse_deployment_configs(text), cluster)

    def to_rows(self) -> list[dict[str, Any]]:
        """The JSON form of plan and pool files: one {tp, pp, cp, [vp,] devices} row per replica."""
        return [
            {**r.config.row(), "devices": list(r.devices)} for r in self.replicas
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
            tp = replica.config.tp
            for s in range(replica.config.pp):
                for k in range(replica.config.cp):
                    nodes = {d // gpn for d in replica.tp_group(s, k)}
                    if len(nodes) > max(1, -(-tp // gpn)):
                        raise HydraulisError(
                            f"deployment {self}: a {replica.config.name} TP group spans nodes {sorted(nodes)}"
                        )
            if model is not None:
                replica.config.validate(model)


def _take(free: list[list[int]], size: int, gpn: int) -> list[int] | None:
    """`size` devices from the first node with room, or size/gpn whole free nodes; None where none has room."""
    if size <= gpn:
        node = next((n for n, f in enumerate(free) if len(f) >= size), None)
        if node is None:
            return None
        taken, free[node] = free[node][:size], free[node][size:]
        return taken
    nodes = [n for n, f in enumerate(free) if len(f) == gpn][: size // gpn]
    if size % gpn or len(nodes) < size // gpn:
        return None
    taken = []
    for n in nodes:
        taken += free[n]
        free[n] = []
    return taken


def _placement_error(configs: Sequence[ParallelConfig], config: ParallelConfig, gpn: int) -> HydraulisError:
    """Why a stage of `config` found no devices, in one line."""
    what, unit = format_configs(configs), config.tp if config.cp > 1 else config.group_size
    if unit > gpn and unit % gpn:
        group, degree = ("TP group", "tp") if config.cp > 1 else ("group", "tp*cp")
        return HydraulisError(
            f"{config.name}: a {group} of {unit} GPUs is larger than a node of {gpn} "
            f"but not a multiple of it; use {degree} that divides {gpn} or is a multiple of it"
        )
    if unit > gpn:
        per = "TP group" if config.cp > 1 else "stage"
        return HydraulisError(f"cannot place {what}: {config.name} needs {unit // gpn} whole free nodes per {per}")
    return HydraulisError(
        f"cannot place {what}: no node has {unit} free GPUs for a {config.name} "
        f"{'TP group' if config.cp > 1 else 'stage'} (a TP group never crosses a node)"
    )


_ITEM = re.compile(r"(?:(\d+)\s*[x*]\s*)?(\(?\s*tp\s*\d+.*)")


def _unbalanced(text: str) -> str:
    """' (unbalanced parentheses)' or ' (nested parentheses)' where they are, for an error message; else ''."""
    depth = 0
    for ch in text:
        depth += (ch == "(") - (ch == ")")
        if depth > 1:
            return " (nested parentheses)"
        if depth < 0:
            break
    return " (unbalanced parentheses)" if depth != 0 else ""


def parse_deployment_configs(text: str) -> list[ParallelConfig]:
    """`1x(tp8,pp1) + 6x(tp2,pp2)` -> [tp8pp1, tp2pp2 x 6]; every part of `text` must parse (the one grammar of
    deployments: items `[N x] CONFIG` joined by '+', a config's parentheses around the whole of it or none)."""
    configs: list[ParallelConfig] = []
    for item in text.lower().split("+"):
        match = _ITEM.fullmatch(item.strip())
        try:
            config = ParallelConfig.parse(match.group(2)) if match else None
        except HydraulisError:
            config = None
        if match is None or config is None:
            raise HydraulisError(
                f"cannot parse deployment item {item.strip()!r}"
                + (f" in {text.strip()!r}" if item.strip() != text.strip() else "") + f"{_unbalanced(item)}; "
                "write e.g. '1x(tp8,pp1) + 6x(tp2,pp2)'"
            )
        count = int(match.group(1) or 1)
        if not 1 <= count <= MAX_GPUS:
            raise HydraulisError(f"deployment {text.strip()!r}: replica count must be 1 to {MAX_GPUS}, got {count}")
        configs += [config] * count
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
