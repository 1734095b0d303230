"""Hugging Face checkpoints of the LLaMA line: weights to and from our model.

Our `StageModel` and transformers' LlamaForCausalLM, MistralForCausalLM,
Qwen2ForCausalLM and Qwen3ForCausalLM compute the same function
(tests/runtime/test_hf_oracle.py checks logits, losses and every gradient),
so a checkpoint moves between them by renaming alone: every tensor maps to
exactly one HF tensor of the same shape and memory layout. No transposes, no
q/k permutation (both use the "half" RoPE layout of `rotate_half`), no fused
QKV. So a rank's TP slice of one of our tensors is the same slice of the HF
tensor, and a sharded loader can read just that slice of a safetensors file
by `hf_name`. Two exceptions, both at the ends of the vocabulary tensors: a
padded vocabulary has extra rows that HF does not (dropped on the way out,
zeros on the way in), and a tied head has no `lm_head.weight` of its own.

The config side (families.py) is torch-free; transformers is imported only
inside `hf_config`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

from hydraulis.errors import HydraulisError
from hydraulis.families import hf_config_kwargs
from hydraulis.runtime.optimizer.layout import full_shapes
from hydraulis.specs import ModelSpec

# Per-layer tensors: our suffix -> HF suffix, under "layers.{i}." and "model.layers.{i}.".
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn.wq.weight": "self_attn.q_proj.weight",
    "attn.wk.weight": "self_attn.k_proj.weight",
    "attn.wv.weight": "self_attn.v_proj.weight",
    "attn.wq.bias": "self_attn.q_proj.bias",  # Qwen2
    "attn.wk.bias": "self_attn.k_proj.bias",
    "attn.wv.bias": "self_attn.v_proj.bias",
    "attn.q_norm.weight": "self_attn.q_norm.weight",  # Qwen3
    "attn.k_norm.weight": "self_attn.k_norm.weight",
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
VOCAB_TENSORS = ("embedding.weight", "output.weight")  # rows = vocabulary (padded in the runtime)
_HF_LAYER_NAMES = {v: k for k, v in _LAYER_NAMES.items()}
_HF_GLOBAL_NAMES = {v: k for k, v in _GLOBAL_NAMES.items()}
_OUR_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
# Derived RoPE buffers that old transformers versions saved in checkpoints; recomputed, so skipped.
_HF_DERIVED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")


def hf_name(our_name: str) -> str:
    """The HF name of one of our full-model parameters (same shape and layout, but for vocabulary padding)."""
    found = _renamed(our_name, _GLOBAL_NAMES, _OUR_LAYER, _LAYER_NAMES, "model.layers.{}.{}")
    if found is None:
        raise HydraulisError(f"no HF tensor for parameter {our_name!r}")
    return found


def our_name(hf_tensor_name: str) -> str:
    """The inverse of `hf_name`: our parameter name of an HF tensor."""
    found = _renamed(hf_tensor_name, _HF_GLOBAL_NAMES, _HF_LAYER, _HF_LAYER_NAMES, "layers.{}.{}")
    if found is None:
        raise HydraulisError(f"HF tensor {hf_tensor_name!r} has no counterpart in a hydraulis model")
    return found


def _renamed(
    name: str, whole: dict[str, str], layer: re.Pattern[str], in_layer: dict[str, str], template: str
) -> str | None:
    """`name` in the other naming: a whole-model tensor's by the table, a layer's by its index and the table."""
    if name in whole:
        return whole[name]
    m = layer.fullmatch(name)
    return template.format(m.group(1), in_layer[m.group(2)]) if m and m.group(2) in in_layer else None


def hf_config(spec: ModelSpec, max_position_embeddings: int = 4096) -> Any:
    """The transformers config of the spec's family computing exactly our model (our eps and theta).

    max_position_embeddings does not change the function (RoPE has no
    length limit); it is only the advertised context length.
    """
    from transformers import AutoConfig

    return AutoConfig.for_model(spec.arch.family, **hf_config_kwargs(spec, max_position_embeddings))


def _check_shape(name: str, tensor: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != expected:
        raise HydraulisError(f"{name}: shape {tuple(tensor.shape)}, expected {expected}")


def _check_complete(names: set[str], expected: Mapping[str, Any], what: str) -> None:
    missing = [n for n in expected if n not in names]
    if missing:
        raise HydraulisError(f"{what} has no {missing[0]!r} ({len(missing)} tensors missing)")


def to_hf_state_dict(ours: Mapping[str, torch.Tensor], spec: ModelSpec) -> dict[str, torch.Tensor]:
    """Our full-model state dict under HF names: the same tensors, the vocabulary ones trimmed to `spec.vocab` rows.

    Every name must be one of `spec`'s, with its shape, and the model complete.
    """
    expected = full_shapes(spec)
    for name, t in ours.items():
        if name not in expected:
            raise HydraulisError(f"state dict has unexpected {name!r} for model {spec.name!r}")
        _check_shape(name, t, expected[name])
    _check_complete(set(ours), expected, "state dict")
    return {hf_name(name): t[: spec.vocab] if name in VOCAB_TENSORS else t for name, t in ours.items()}


def from_hf_state_dict(hf: Mapping[str, torch.Tensor], spec: ModelSpec) -> dict[str, torch.Tensor]:
    """An HF state dict under our names, for `StageModel.load_full_state_dict`.

    Checks that every tensor of `spec` is there with its shape and that
    nothing else is (old checkpoints' saved `rotary_emb.inv_freq` buffers are
    skipped: they are recomputed; so is a tied model's `lm_head.weight`, the
    embedding itself). Padded vocabulary rows are zeros.
    """
    expected = full_shapes(spec)
    ours = {}
    for name, t in hf.items():
        if _HF_DERIVED.fullmatch(name) or (name == "lm_head.weight" and spec.arch.tied_embeddings):
            continue
        mine = our_name(name)
        if mine not in expected:
            raise HydraulisError(f"HF state dict has unexpected {name!r} for model {spec.name!r}")
        if mine in VOCAB_TENSORS:
            _check_shape(name, t, (spec.vocab, *expected[mine][1:]))
            t = torch.cat([t, t.new_zeros(spec.vocab_rows - spec.vocab, *t.shape[1:])]) if spec.padded_vocab else t
        _check_shape(name, t, expected[mine])
        ours[mine] = t
    missing = [hf_name(n) for n in expected if n not in ours]
    if missing:
        raise HydraulisError(f"HF state dict has no {missing[0]!r} ({len(missing)} tensors missing)")
    return ours
