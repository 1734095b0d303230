"""RMSNorm and SwiGLU that keep less for backward than autograd's own ops (Apex's and Megatron's fused kernels).

Autograd, op by op, keeps for an RMSNorm its input in fp32, the rsqrt and
the normalized values, and for a SwiGLU the two projections, silu's output
and the product: in bf16, 8 of a LLaMA layer's 47.5 bytes per token and
hidden column went to the norms and 5.4 to silu's output. These functions
keep only the input (compute dtype) and the fp32 rsqrt, and the two
projections, and recompute the rest in backward (element-wise work, no
GEMM), in fp32 as the forward computes it. Their outputs and gradients are
those of the op-by-op forms (tests/runtime/test_hf_oracle.py checks them
against transformers); cost/activations.py counts what they keep.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        x32 = x.float()
        rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, rstd, weight)
        return (x32 * rstd).to(x.dtype) * weight

    @staticmethod
    def backward(ctx, grad):
        x, rstd, weight = ctx.saved_tensors
        normed = x.float() * rstd  # a new tensor: in fp32 x.float() is x itself
        grad_weight = (grad.float() * normed.to(x.dtype).float()).reshape(-1, weight.shape[-1]).sum(0)
        grad_normed = (grad * weight).float()
        dot = (grad_normed * normed).mean(-1, keepdim=True)
        grad_x = grad_normed.sub_(normed.mul_(dot)).mul_(rstd)
        return grad_x.to(x.dtype), grad_weight.to(weight.dtype), None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """(x / rms(x)) in x's dtype times the weight, over the last dimension; normalized in fp32."""
    return _RMSNorm.apply(x, weight, eps)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        g32, sigmoid = gate.float(), torch.sigmoid(gate.float())
        silu = g32 * sigmoid
        grad32 = grad.float()
        grad_up = grad32 * silu.to(gate.dtype).float()
        grad_gate = grad32.mul_(up.float()).mul_(sigmoid.mul_(1 + g32 * (1 - sigmoid)))
        return grad_gate.to(gate.dtype), grad_up.to(up.dtype)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, keeping only gate and up for backward."""
    return _SwiGLU.apply(gate, up)
