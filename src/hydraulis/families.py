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
`hf_config_kwargs` writes the family back. The launcher (job.py) reads
configs through here, so a bad model fails before any rank starts.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hydraulis.errors import HydraulisError
from hydraulis.jsonio import read_json_object
from hydraulis.specs import FAMILIES, Architecture, ModelSpec

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}  # fmt: skip
CONFIG_FILE = "config.json"
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
