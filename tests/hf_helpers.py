"""Transformers models for the outside-oracle tests, with weights that make the comparison mean something."""

from __future__ import annotations

from typing import Any


def spread_weights(model: Any) -> Any:
    """Random weights, scaled so that attention is far from uniform and norms are not all ones (in place)."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif name == "model.embed_tokens.weight":
                p.normal_()
            else:  # (out, in): unit-variance outputs, attention logits of order one
                p.normal_(std=p.shape[1] ** -0.5)
    return model
