"""Hugging Face model families <-> our ModelSpec, as plain config dicts (no torch, no transformers).

The families of the LLaMA line that our one decoder computes exactly, each
as options of `Architecture` (specs.py):

- llama (1, 2, 3): plain RoPE or LLaMA 3's `rope_scaling` (type llama3);
- mistral: LLaMA's layer; refused when its sliding window would act (shorter than max_len);
- qwen2 (and Qwen2.5): biases on q, k and v, optionally tied embeddings;
- qwen3: RMSNorm of each q and k head, its own head_dim.

`spec_from_hf_config` reads a `config.json` (transformers 4.x with
`rope_theta`/`rope_scaling` or 5.x with `rope_parameters`) and refuses, in one
line naming the key, anything the runtime would compute differently;
`hf_config_kwargs` writes the family back. `weight_headers` reads the
safetensors headers (every tensor's file, dtype and shape) without reading
any weight. The launcher (job.py) reads configs and headers through here,
so a bad model fails before any rank starts.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hydraulis.errors import HydraulisError
from hydraulis.files import not_found, read_json_object
from hydraulis.specs import FAMILIES, Architecture, ModelSpec

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}  # fmt: skip
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
HEADER_LIMIT = 100 << 20  # safetensors' own limit on a header's size
# Defaults of each family's transformers config class, where they differ and matter to us.
_DEFAULT_EPS = 1e-6
_DEFAULT_THETA = 10000.0
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _refuse(key: str, value: Any, supported: str) -> HydraulisError:
    return HydraulisError(f"HF config: {key} is {value!r}; hydraulis supports only {supported}")


def _rope(config: Mapping[str, Any], family: str) -> tuple[float, tuple[float, float, float, int] | None]:
    """(theta, LLaMA 3 scaling or None) of a 4.x (rope_theta, rope_scaling) or 5.x (rope_parameters) config."""
    theta = config.get("rope_theta", _DEFAULT_THETA)
    llama3 = None
    for key in ("rope_parameters", "rope_scaling"):
        params = config.get(key) or {}
        theta = params.get("rope_theta", theta)
        kind = params.get("rope_type", params.get("type", "default"))
        if kind == "default":
            continue
        if kind != "llama3" or family != "llama":
            raise _refuse(f"{key}.rope_type", kind, "'default' and, for llama, 'llama3'")
        missing = [k for k in _LLAMA3_KEYS if k not in params]
        if missing:
            raise HydraulisError(f"HF config: {key} of type llama3 has no {missing[0]!r}")
        factor, low, high, original = (params[k] for k in _LLAMA3_KEYS)
        if not (factor > 0 and high > low > 0 and original > 0):
            raise _refuse(key, dict(params), "factor > 0, high_freq_factor > low_freq_factor > 0")
        llama3 = (float(factor), float(low), float(high), int(original))
    return float(theta), llama3


def _sliding_window(config: Mapping[str, Any], family: str, max_len: int | None) -> None:
    """Refuse a sliding window that would act on sequences up to max_len (we attend to the whole document)."""
    window = config.get("sliding_window", 4096 if family != "llama" else None)
    if family == "mistral":
        acts = window is not None
    elif family in ("qwen2", "qwen3"):
        types = config.get("layer_types")
        if types is not None:
            acts = "sliding_attention" in types
        else:
            acts = bool(config.get("use_sliding_window")) and config.get("max_window_layers", 28) < config.get(
                "num_hidden_layers", 32
            )
    else:
        acts = False
    if acts and window is not None and max_len is not None and window < max_len:
        raise HydraulisError(
            f"HF config: sliding_window is {window}, below max_len {max_len}; hydraulis attends to whole "
            "documents, so lower data.max_len to the window or use a model without one"
        )


def spec_from_hf_config(config_dict: Mapping[str, Any], name: str, max_len: int | None = None) -> ModelSpec:
    """The ModelSpec of an HF config; refuses, naming the key, whatever our model cannot compute.

    Missing keys take the family's transformers defaults (rms_norm_eps 1e-6,
    Qwen3's head_dim 128). With `max_len`, a sliding window shorter than it is refused.
    """
    c = config_dict
    family = c.get("model_type")
    if family not in FAMILIES:
        raise _refuse("model_type", family, ", ".join(repr(f) for f in FAMILIES))
    checks = [("hidden_act", "silu", "'silu' (SwiGLU)"), ("mlp_bias", False, "false")]
    if family in ("llama", "qwen3"):  # their attention_bias also puts a bias on o_proj
        checks.append(("attention_bias", False, "false (no biases)"))
    for key, default, say in checks:
        if c.get(key, default) != default:
            raise _refuse(key, c.get(key, default), say)
    if c.get("attention_dropout") or 0.0:
        raise _refuse("attention_dropout", c["attention_dropout"], "0 (no dropout)")
    missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                           "num_attention_heads") if k not in c]  # fmt: skip
    if missing:
        raise HydraulisError(f"HF config has no {missing[0]!r}")
    _sliding_window(c, family, max_len)
    heads, hidden = c["num_attention_heads"], c["hidden_size"]
    kv_heads = c.get("num_key_value_heads") or heads  # None means MHA
    natural = hidden // heads
    head_dim = c.get("head_dim", 128 if family == "qwen3" else None) or natural
    if head_dim != natural and family != "qwen3":
        raise _refuse("head_dim", head_dim, f"hidden_size / num_attention_heads = {natural} for {family}")
    theta, llama3 = _rope(c, family)
    arch = Architecture(
        family=family,
        qkv_bias=family == "qwen2",
        qk_norm=family == "qwen3",
        tied_embeddings=bool(c.get("tie_word_embeddings", False)),
        rope_theta=theta,
        norm_eps=float(c.get("rms_norm_eps", _DEFAULT_EPS)),
        rope_llama3=llama3,
        head_dim=head_dim if head_dim != natural or hidden % heads else 0,
    )
    return ModelSpec(
        name,
        layers=c["num_hidden_layers"],
        hidden=hidden,
        ffn=c["intermediate_size"],
        heads=heads,
        kv_heads=kv_heads,
        vocab=c["vocab_size"],
        arch=arch,
    )


def hf_config_kwargs(spec: ModelSpec, max_position_embeddings: int = 4096) -> dict[str, Any]:
    """Keyword arguments of the family's transformers config class computing exactly `spec` (export, tests).

    Written with 4.x keys (rope_theta, rope_scaling), which transformers 5
    turns into rope_parameters. No sliding window; no pad token (a
    padding_idx would freeze that embedding row's gradient in HF).
    """
    a = spec.arch
    kwargs: dict[str, Any] = {
        "vocab_size": spec.vocab,
        "hidden_size": spec.hidden,
        "intermediate_size": spec.ffn,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "hidden_act": "silu",
        "rms_norm_eps": a.norm_eps,
        "rope_theta": a.rope_theta,
        "max_position_embeddings": max_position_embeddings,
        "tie_word_embeddings": a.tied_embeddings,
        "attention_dropout": 0.0,
        "pad_token_id": None,
    }
    if a.rope_llama3 is not None:
        kwargs["rope_scaling"] = {"rope_type": "llama3", "rope_theta": a.rope_theta,
                                  **dict(zip(_LLAMA3_KEYS, a.rope_llama3, strict=True))}  # fmt: skip
    if a.family != "qwen2":  # Qwen2Config has no head_dim: always hidden / heads
        kwargs["head_dim"] = spec.head_dim
    if a.family in ("llama", "qwen3"):
        kwargs["attention_bias"] = False
    if a.family == "llama":
        kwargs["mlp_bias"] = False
    if a.family == "mistral":
        kwargs["sliding_window"] = None
    if a.family in ("qwen2", "qwen3"):
        kwargs["use_sliding_window"] = False
    return kwargs


def read_hf_config(hf_dir: str | Path, max_len: int | None = None) -> tuple[Path, dict[str, Any], ModelSpec]:
    """(config path, config dict, spec) of an HF directory; a config we cannot compute names the file."""
    path = Path(hf_dir) / CONFIG_FILE
    config = read_json_object(path, missing="no such file (not a Hugging Face model directory)")
    try:
        spec = spec_from_hf_config(config, Path(hf_dir).name or "hf", max_len)
    except HydraulisError as exc:
        raise HydraulisError(f"{path}: {exc}") from None
    return path, config, spec


def hf_tensor_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every tensor an HF checkpoint of the spec's family holds, with its shape (vocabulary tensors: `vocab`
    rows); the runtime's own names and shapes map onto these one to one (runtime/storage/hf.py, tested)."""
    h, d, ffn = spec.hidden, spec.head_dim, spec.ffn
    q, kv = spec.heads * d, spec.kv_heads * d
    layer = {"input_layernorm.weight": (h,), "self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h),
             "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, q),
             "post_attention_layernorm.weight": (h,), "mlp.gate_proj.weight": (ffn, h),
             "mlp.up_proj.weight": (ffn, h), "mlp.down_proj.weight": (h, ffn)}  # fmt: skip
    if spec.arch.qkv_bias:
        layer.update({"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,)})
    if spec.arch.qk_norm:
        layer.update({"self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,)})
    out = {"model.embed_tokens.weight": (spec.vocab, h)}
    out.update({f"model.layers.{i}.{name}": shape for i in range(spec.layers) for name, shape in layer.items()})
    out["model.norm.weight"] = (h,)
    if not spec.arch.tied_embeddings:
        out["lm_head.weight"] = (spec.vocab, h)
    return out


def check_weights(hf_dir: str | Path, spec: ModelSpec) -> dict[str, Path]:
    """Every tensor `spec` needs is in the HF directory's weights with its shape, read from the safetensors
    headers alone (no torch, no weight read); HF name -> file. One line naming the file otherwise."""
    headers = weight_headers(hf_dir)
    files = {}
    for name, want in hf_tensor_shapes(spec).items():
        if name not in headers:
            first = next(iter(headers.values()))[0] if headers else Path(hf_dir) / WEIGHTS_FILE
            raise HydraulisError(f"{first}: the weights have no {name!r}, which {spec.describe()} needs")
        path, _, shape = headers[name]
        if shape != want:
            raise HydraulisError(f"{path}: {name} has shape {shape}, the model's config says {want}")
        files[name] = path
    return files


def weight_headers(hf_dir: str | Path) -> dict[str, tuple[Path, str, tuple[int, ...]]]:
    """Tensor name -> (file, dtype, shape) of an HF directory's safetensors weights (one file or a sharded
    index), from the files' headers alone; a missing, truncated or foreign file is one line naming it."""
    hf_dir = Path(hf_dir)
    index = hf_dir / WEIGHTS_INDEX
    weight_map = None
    if index.is_file():
        weight_map = read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
            raise HydraulisError(f"{index}: no weight_map of tensor name -> file (not a safetensors index)")
    out = {}
    for name in sorted(set(weight_map.values())) if weight_map else [WEIGHTS_FILE]:
        path = hf_dir / name
        out.update({t: (path, dtype, shape) for t, (dtype, shape) in _header(path).items()})
    for tensor, name in (weight_map or {}).items():
        if tensor not in out or out[tensor][0].name != name:
            raise HydraulisError(f"{index}: {tensor!r} is not in {hf_dir / name}")
    return out


def weights_digest(hf_dir: str | Path) -> str:
    """16 hex digits of the sha256 of the weights' headers (names, dtypes, shapes): what they hold, wherever."""
    headers = weight_headers(hf_dir)
    text = json.dumps(sorted((name, dtype, list(shape)) for name, (_, dtype, shape) in headers.items()))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _header(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """One safetensors file's tensors: 8 bytes of header length, the JSON header, then the data it spans."""
    try:
        with path.open("rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            length = int.from_bytes(fh.read(8), "little") if size >= 8 else 0
            if not 2 <= length <= min(HEADER_LIMIT, size - 8):
                raise HydraulisError(f"{path}: not a safetensors file (a header of {length} bytes in {size})")
            header = json.loads(fh.read(length))
    except FileNotFoundError:
        raise HydraulisError(not_found(path, "no such file (only safetensors weights are read)")) from None
    except (UnicodeDecodeError, ValueError):
        raise HydraulisError(f"{path}: not a safetensors file (its header is not JSON)") from None
    except OSError as exc:
        raise HydraulisError(f"{path}: cannot read: {exc.strerror or exc}") from None
    tensors, end = {}, 0
    try:
        for name, entry in header.items():
            if name != "__metadata__":
                tensors[name] = (str(entry["dtype"]), tuple(int(n) for n in entry["shape"]))
                end = max(end, int(entry["data_offsets"][1]))
    except (AttributeError, KeyError, TypeError, ValueError, IndexError):
        raise HydraulisError(f"{path}: not a safetensors file (a header entry lacks dtype, shape or offsets)") from None
    if 8 + length + end > size:
        raise HydraulisError(f"{path}: truncated: {size:,} bytes, its header says {8 + length + end:,}")
    return tensors
