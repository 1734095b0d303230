"""Hugging Face LLaMA: configs and weights to and from our model.

Our `StageModel` and transformers' `LlamaForCausalLM` compute the same
function (tests/runtime/test_hf_oracle.py checks logits, losses and every
gradient), so a checkpoint moves between them by renaming alone: every tensor
maps to exactly one HF tensor of the same shape and memory layout. No
transposes, no q/k permutation (both use the "half" RoPE layout of
`rotate_half`), no fused QKV. So a rank's TP slice of one of our tensors is the
same slice of the HF tensor, and a sharded loader can read just that slice of
a safetensors file by `hf_name`.

transformers is imported only inside `hf_config`; the rest works on names,
shapes and plain config dicts (`config.json` or `LlamaConfig.to_dict()`, of
transformers 4.x with `rope_theta`/`rope_scaling` or 5.x with
`rope_parameters`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from hydraulis.errors import HydraulisError
from hydraulis.runtime.layout import full_shapes
from hydraulis.runtime.model import NORM_EPS, ROPE_THETA
from hydraulis.specs import ModelSpec

if TYPE_CHECKING:
    from transformers import LlamaConfig

# Per-layer tensors: our suffix -> HF suffix, under "layers.{i}." and "model.layers.{i}.".
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn.wq.weight": "self_attn.q_proj.weight",
    "attn.wk.weight": "self_attn.k_proj.weight",
    "attn.wv.weight": "self_attn.v_proj.weight",
    "attn.wo.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn.w1.weight": "mlp.gate_proj.weight",  # silu(w1 x) * w3 x: w1 is the gate
    "ffn.w3.weight": "mlp.up_proj.weight",
    "ffn.w2.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "embedding.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_HF_LAYER_NAMES = {v: k for k, v in _LAYER_NAMES.items()}
_HF_GLOBAL_NAMES = {v: k for k, v in _GLOBAL_NAMES.items()}
_OUR_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
# Derived RoPE buffers that old transformers versions saved in checkpoints; recomputed, so skipped.
_HF_DERIVED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")


def hf_name(our_name: str) -> str:
    """The HF LlamaForCausalLM name of one of our full-model parameters (same shape and layout)."""
    if our_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[our_name]
    m = _OUR_LAYER.fullmatch(our_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    raise HydraulisError(f"no HF LLaMA tensor for parameter {our_name!r}")


def our_name(hf_tensor_name: str) -> str:
    """The inverse of `hf_name`: our parameter name of an HF LlamaForCausalLM tensor."""
    if hf_tensor_name in _HF_GLOBAL_NAMES:
        return _HF_GLOBAL_NAMES[hf_tensor_name]
    m = _HF_LAYER.fullmatch(hf_tensor_name)
    if m and m.group(2) in _HF_LAYER_NAMES:
        return f"layers.{m.group(1)}.{_HF_LAYER_NAMES[m.group(2)]}"
    raise HydraulisError(f"HF tensor {hf_tensor_name!r} has no counterpart in a hydraulis LLaMA model")


def hf_config(spec: ModelSpec, max_position_embeddings: int = 4096) -> LlamaConfig:
    """A transformers LlamaConfig computing exactly our model (our eps and theta, not HF's defaults).

    max_position_embeddings does not change the function (plain RoPE has no
    length limit); it is only the advertised context length.
    """
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=spec.vocab,
        hidden_size=spec.hidden,
        intermediate_size=spec.ffn,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        head_dim=spec.head_dim,
        hidden_act="silu",
        rms_norm_eps=NORM_EPS,  # HF's default is 1e-6
        rope_theta=ROPE_THETA,  # transformers 5 turns it into rope_parameters
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        attention_dropout=0.0,
        pad_token_id=None,  # a padding_idx would freeze that embedding row's gradient in HF
    )


def _refuse(key: str, value: Any, supported: str) -> HydraulisError:
    return HydraulisError(f"HF config: {key} is {value!r}; hydraulis supports only {supported}")


def _rope_theta(config: Mapping[str, Any]) -> tuple[str, float]:
    """(key, RoPE theta) of a transformers 4.x (rope_theta, rope_scaling) or 5.x (rope_parameters) config."""
    scaling = config.get("rope_scaling")
    if scaling is not None and scaling.get("rope_type", scaling.get("type")) != "default":
        raise _refuse("rope_scaling", scaling, "plain RoPE (rope_scaling null)")
    params = config.get("rope_parameters")
    if params is not None:
        if "rope_type" in params and params["rope_type"] != "default":
            raise _refuse("rope_parameters.rope_type", params["rope_type"], "'default' (plain RoPE)")
        if "rope_theta" in params:
            return "rope_parameters.rope_theta", params["rope_theta"]
    return "rope_theta", config.get("rope_theta", 10000.0)  # LlamaConfig's default


def spec_from_hf_config(config_dict: Mapping[str, Any], name: str) -> ModelSpec:
    """The ModelSpec of an HF LLaMA config; refuses, naming the key, whatever our model cannot compute.

    Missing keys take LlamaConfig's defaults, so a config whose rms_norm_eps is
    absent means 1e-6 and is refused, as HF would compute it.
    """
    c = config_dict
    checks = (  # key, LlamaConfig default, supported value, what to say
        ("model_type", None, "llama", "'llama'"),
        ("hidden_act", "silu", "silu", "'silu' (SwiGLU)"),
        ("attention_bias", False, False, "false (no biases)"),
        ("mlp_bias", False, False, "false (no biases)"),
        ("tie_word_embeddings", False, False, "false (untied output head)"),
    )
    for key, default, supported, say in checks:
        if c.get(key, default) != supported:
            raise _refuse(key, c.get(key, default), say)
    eps = c.get("rms_norm_eps", 1e-6)
    if not math.isclose(eps, NORM_EPS, rel_tol=1e-9):
        raise _refuse("rms_norm_eps", eps, f"{NORM_EPS:g}")
    key, theta = _rope_theta(c)
    if not math.isclose(theta, ROPE_THETA, rel_tol=1e-9):
        raise _refuse(key, theta, f"{ROPE_THETA:g}")
    if c.get("attention_dropout") or 0.0:
        raise _refuse("attention_dropout", c["attention_dropout"], "0 (no dropout)")
    missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                           "num_attention_heads") if k not in c]  # fmt: skip
    if missing:
        raise HydraulisError(f"HF config has no {missing[0]!r}")
    heads = c["num_attention_heads"]
    kv_heads = c.get("num_key_value_heads") or heads  # LlamaConfig: None means MHA
    if c.get("head_dim") not in (None, c["hidden_size"] // heads):
        raise _refuse("head_dim", c["head_dim"], f"hidden_size / num_attention_heads = {c['hidden_size'] // heads}")
    return ModelSpec(
        name,
        layers=c["num_hidden_layers"],
        hidden=c["hidden_size"],
        ffn=c["intermediate_size"],
        heads=heads,
        kv_heads=kv_heads,
        vocab=c["vocab_size"],
    )


def _check_shape(name: str, tensor: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != expected:
        raise HydraulisError(f"{name}: shape {tuple(tensor.shape)}, expected {expected}")


def _check_complete(names: set[str], expected: Mapping[str, Any], what: str) -> None:
    missing = [n for n in expected if n not in names]
    if missing:
        raise HydraulisError(f"{what} has no {missing[0]!r} ({len(missing)} tensors missing)")


def to_hf_state_dict(ours: Mapping[str, torch.Tensor], spec: ModelSpec | None = None) -> dict[str, torch.Tensor]:
    """Our full-model state dict under HF LlamaForCausalLM names (same tensors, not copies).

    Every name must be one of ours and the model complete; with `spec`, the
    shapes are checked too (without, the layer count comes from the names).
    """
    if spec is not None:
        expected = full_shapes(spec)
        for name, t in ours.items():
            if name not in expected:
                raise HydraulisError(f"state dict has unexpected {name!r} for model {spec.name!r}")
            _check_shape(name, t, expected[name])
    else:
        layers = [int(m.group(1)) for n in ours if (m := _OUR_LAYER.fullmatch(n))]
        layer_keys = {f"layers.{i}.{k}" for i in range(max(layers, default=-1) + 1) for k in _LAYER_NAMES}
        expected = {**dict.fromkeys(_GLOBAL_NAMES), **dict.fromkeys(sorted(layer_keys))}
    hf = {hf_name(name): t for name, t in ours.items()}
    _check_complete(set(ours), expected, "state dict")
    return hf


def from_hf_state_dict(hf: Mapping[str, torch.Tensor], spec: ModelSpec) -> dict[str, torch.Tensor]:
    """An HF LlamaForCausalLM state dict under our names, for `StageModel.load_full_state_dict`.

    Checks that every tensor of `spec` is there with its shape and that
    nothing else is (old checkpoints' saved `rotary_emb.inv_freq` buffers are
    skipped: they are recomputed).
    """
    expected = full_shapes(spec)
    ours = {}
    for name, t in hf.items():
        if _HF_DERIVED.fullmatch(name):
            continue
        mine = our_name(name)
        if mine not in expected:
            raise HydraulisError(f"HF state dict has unexpected {name!r} for model {spec.name!r}")
        _check_shape(name, t, expected[mine])
        ours[mine] = t
    missing = [hf_name(n) for n in expected if n not in ours]
    if missing:
        raise HydraulisError(f"HF state dict has no {missing[0]!r} ({len(missing)} tensors missing)")
    return ours
