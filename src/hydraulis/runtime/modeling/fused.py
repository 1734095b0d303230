"""RMSNorm and SwiGLU that keep less for backward than autograd's own ops (Apex's and Megatron's fused kernels).

Autograd, op by op, keeps for an RMSNorm its input in fp32, the rsqrt and
the normalized values, and for a SwiGLU the two projections, silu's output
and the product: in bf16, 8 of a LLaMA layer's 47.5 bytes per token and
hidden column went to the norms and 5.4 to silu's output. These functions
keep only the input (compute dtype) and the fp32 rsqrt, and the two
projections, and recompute the rest in backward (element-wise work, no
GEMM): the norm in fp32 as its forward, SwiGLU in the compute dtype and in
place but for silu's derivative, in fp32 (two temporaries beside its gradients). Their outputs and gradients are
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
        x32 = x.float()
        normed = x32 * rstd if x32 is x else x32.mul_(rstd)  # fp32: x.float() is x itself, which stays
        grad_weight = (grad * normed.to(x.dtype)).float().reshape(-1, weight.shape[-1]).sum(0)
        grad_x = (grad * weight).float()
        dot = (grad_x * normed).mean(-1, keepdim=True)
        grad_x.sub_(normed.mul_(dot)).mul_(rstd)
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
        # In place where it can; silu's derivative (sigmoid and its complement) in fp32 beside the two gradients.
        gate, up = ctx.saved_tensors
        grad_up = (gate * torch.sigmoid(gate)).mul_(grad)
        # silu's derivative in fp32: in the compute dtype its rounding alone put bf16 gradients past 7e-3 of fp32's
        factor = torch.sigmoid(gate.float())
        factor = torch.sub(1, factor).mul_(gate).add_(1).mul_(factor).to(gate.dtype)
        grad_gate = factor.mul_(grad).mul_(up)
        return grad_gate, grad_up


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, keeping only gate and up for backward."""
    return _SwiGLU.apply(gate, up)
