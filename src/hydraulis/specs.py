"""Model shapes, device specs and cluster specs, with presets.

Plain data: the cost model, the planner and the runtime all read these.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hydraulis.errors import HydraulisError

GiB = 2**30
DTYPE_NAMES = ("fp32", "bf16")  # compute dtypes; runtime/trainer.py maps them to torch's
DTYPE_BYTES = {"fp32": 4, "bf16": 2}  # bytes per element of each compute dtype (the memory model's)
FAMILIES = ("llama", "mistral", "qwen2", "qwen3")  # Hugging Face model_type values the runtime computes


@dataclass(frozen=True)
class Architecture:
    """What sets the supported decoder families apart, as options of one model (not subclasses).

    Defaults are hydraulis' own LLaMA. `rope_llama3` is LLaMA 3's frequency
    scaling: (factor, low_freq_factor, high_freq_factor, original_max_position_embeddings).
    `head_dim` 0 means hidden / heads (Qwen3 sets its own).
    """

    family: str = "llama"
    qkv_bias: bool = False  # Qwen2: biases on the q, k and v projections
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k, before RoPE
    tied_embeddings: bool = False  # the head reuses the input embedding
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    rope_llama3: tuple[float, float, float, int] | None = None
    head_dim: int = 0

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise HydraulisError(f"model family {self.family!r} is not supported; supported: {', '.join(FAMILIES)}")

    def to_dict(self) -> dict[str, Any]:
        """JSON of the options (lists, not tuples, so a dict read back compares equal)."""
        d = dataclasses.asdict(self)
        d["rope_llama3"] = None if self.rope_llama3 is None else list(self.rope_llama3)
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str) -> Architecture:
        """The inverse of `to_dict` (a manifest's JSON); an unknown key or bad type names it."""
        known = {f.name: f for f in dataclasses.fields(cls)}
        values = {}
        for key, value in data.items():
            if key not in known:
                raise HydraulisError(f"{where}: unknown architecture key {key!r}")
            if key == "rope_llama3" and value is not None:
                if not isinstance(value, list | tuple) or len(value) != 4:
                    raise HydraulisError(f"{where}.rope_llama3: expected 4 numbers or null, got {value!r}")
                value = (float(value[0]), float(value[1]), float(value[2]), int(value[3]))
            values[key] = value
        return cls(**values)


@dataclass(frozen=True)
class ModelSpec:
    """A decoder of the LLaMA line: RMSNorm, RoPE, SwiGLU, GQA; `arch` holds the family's options.

    `vocab` is the tokenizer's vocabulary (the rows an export has);
    `padded_vocab`, when set, is the number of embedding and head rows the
    runtime holds so that every TP degree of the pool splits them (Megatron's
    padding; the extra logits are masked, the export trims them).
    """

    name: str
    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    vocab: int
    padded_vocab: int = 0  # 0: no padding
    arch: Architecture = Architecture()

    def __post_init__(self) -> None:
        for field in SHAPE_FIELDS:
            if getattr(self, field) <= 0:
                raise HydraulisError(f"model {self.name!r}: {field} must be positive")
        if self.padded_vocab and self.padded_vocab < self.vocab:
            raise HydraulisError(f"model {self.name!r}: padded_vocab {self.padded_vocab} is below vocab {self.vocab}")
        if self.hidden % self.heads and not self.arch.head_dim:
            raise HydraulisError(f"model {self.name!r}: hidden {self.hidden} is not divisible by heads {self.heads}")
        if self.heads % self.kv_heads:
            raise HydraulisError(
                f"model {self.name!r}: heads {self.heads} is not divisible by kv_heads {self.kv_heads}"
            )

    def shape(self) -> dict[str, int]:
        """The fields that define the model's tensors (everything but the name)."""
        return {k: getattr(self, k) for k in SHAPE_FIELDS}

    def shape_differences(self, other: ModelSpec) -> list[str]:
        """The shape fields in which `other` differs from this model (names do not count)."""
        return [k for k in SHAPE_FIELDS if getattr(self, k) != getattr(other, k)]

    def same_shape(self, other: ModelSpec) -> bool:
        return not self.shape_differences(other)

    def tensor_differences(self, other: ModelSpec) -> list[str]:
        """`shape_differences` plus the embedding rows and the family's options: what makes the weights differ."""
        differ = self.shape_differences(other)
        if self.vocab_rows != other.vocab_rows:
            differ.append("padded_vocab")
        return differ + [
            f"arch.{f.name}"
            for f in dataclasses.fields(Architecture)
            if getattr(self.arch, f.name) != getattr(other.arch, f.name)
        ]

    @property
    def vocab_rows(self) -> int:
        """Rows of the embedding and the head in the runtime: the padded vocabulary, if padded."""
        return self.padded_vocab or self.vocab

    def padded_for(self, tp_degrees: list[int] | tuple[int, ...] | set[int]) -> ModelSpec:
        """This model with its vocabulary padded up to a multiple of every TP degree (unchanged if all split it)."""
        multiple = math.lcm(1, *tp_degrees)
        rows = -(-self.vocab // multiple) * multiple
        return dataclasses.replace(self, padded_vocab=rows if rows != self.vocab else 0)

    def to_dict(self) -> dict[str, Any]:
        """JSON of the spec (a checkpoint manifest's "model")."""
        return {"name": self.name, **self.shape(), "padded_vocab": self.padded_vocab, "arch": self.arch.to_dict()}

    def describe(self) -> str:
        """`tiny (layers=4, hidden=256, ...)`: the name and the shape (padding, family), for error messages."""
        extra = {"padded_vocab": self.padded_vocab} if self.padded_vocab else {}
        if self.arch != Architecture():
            extra["family"] = self.arch.family
        return f"{self.name} ({', '.join(f'{k}={v}' for k, v in {**self.shape(), **extra}.items())})"

    @property
    def head_dim(self) -> int:
        return self.arch.head_dim or self.hidden // self.heads

    @property
    def params_per_layer(self) -> int:
        """Q, O (h*q_dim each), K, V (h*kv_dim each), SwiGLU (3*h*ffn), two norms (biases and q/k norms aside)."""
        q_dim, kv_dim = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return 2 * self.hidden * q_dim + 2 * self.hidden * kv_dim + 3 * self.hidden * self.ffn + 2 * self.hidden

    @property
    def embedding_params(self) -> int:
        """Input embedding plus the output head (unless tied) plus the final norm."""
        tables = 1 if self.arch.tied_embeddings else 2
        return tables * self.vocab_rows * self.hidden + self.hidden

    @property
    def num_params(self) -> int:
        return self.layers * self.params_per_layer + self.embedding_params


SHAPE_FIELDS: tuple[str, ...] = ("layers", "hidden", "ffn", "heads", "kv_heads", "vocab")


@dataclass(frozen=True)
class DeviceSpec:
    """One accelerator. Bandwidths are per GPU, per direction, in bytes/s."""

    name: str
    memory_bytes: int
    peak_flops: float  # dense bf16
    intra_node_bw: float
    inter_node_bw: float
    gpus_per_node: int = 8
    p2p_latency_s: float = 10e-6


@dataclass(frozen=True)
class ClusterSpec:
    num_gpus: int
    gpus_per_node: int = 8

    def __post_init__(self) -> None:
        if self.num_gpus <= 0:
            raise HydraulisError(f"cluster: number of GPUs must be positive, got {self.num_gpus}")
        if self.gpus_per_node <= 0:
            raise HydraulisError(f"cluster: GPUs per node must be positive, got {self.gpus_per_node}")

    @property
    def num_nodes(self) -> int:
        return -(-self.num_gpus // self.gpus_per_node)


MODELS: dict[str, ModelSpec] = {
    m.name: m
    for m in (
        # Tiny shapes for CPU tests: divisible by tp in {1, 2, 4} and pp in {1, 2, 4}.
        ModelSpec("tiny", layers=4, hidden=64, ffn=176, heads=4, kv_heads=2, vocab=512),
        ModelSpec("tiny-mha", layers=4, hidden=64, ffn=176, heads=4, kv_heads=4, vocab=512),
        ModelSpec("small", layers=8, hidden=256, ffn=688, heads=8, kv_heads=4, vocab=50304),
        # Shapes of the published work (docs/design.md, section 4).
        ModelSpec("llama-7b", layers=32, hidden=4096, ffn=11008, heads=32, kv_heads=32, vocab=32000),
        ModelSpec("llama-13b", layers=40, hidden=5120, ffn=13824, heads=40, kv_heads=40, vocab=32000),
        ModelSpec("llama-32b", layers=60, hidden=6656, ffn=17920, heads=64, kv_heads=64, vocab=32000),
        ModelSpec("llama-70b", layers=80, hidden=8192, ffn=28672, heads=64, kv_heads=8, vocab=32000),
    )
}

DEVICES: dict[str, DeviceSpec] = {
    d.name: d
    for d in (
        # NVLink per direction; one 200/400 Gb/s NIC per GPU for inter-node.
        DeviceSpec("a100-40g", 40 * GiB, 312e12, intra_node_bw=300e9, inter_node_bw=25e9),
        DeviceSpec("a800-80g", 80 * GiB, 312e12, intra_node_bw=200e9, inter_node_bw=25e9),
        DeviceSpec("h100-80g", 80 * GiB, 989e12, intra_node_bw=450e9, inter_node_bw=50e9),
        DeviceSpec("h200-141g", 141 * GiB, 989e12, intra_node_bw=450e9, inter_node_bw=50e9),
        # One CPU process per rank (gloo over loopback): numbers of the right shape for planning tests
        # and CPU runs until `hydraulis profile` measures the machine.
        DeviceSpec("cpu", 16 * GiB, 20e9, intra_node_bw=2e9, inter_node_bw=1e9, gpus_per_node=64, p2p_latency_s=100e-6),
    )
}


def get_model(name: str) -> ModelSpec:
    try:
        return MODELS[name]
    except KeyError:
        raise HydraulisError(f"unknown model {name!r}; known models: {', '.join(MODELS)}") from None


def get_device(name: str) -> DeviceSpec:
    try:
        return DEVICES[name]
    except KeyError:
        raise HydraulisError(f"unknown device {name!r}; known devices: {', '.join(DEVICES)}") from None
