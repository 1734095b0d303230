"""Varlen causal attention over concatenated documents, from `cu_seqlens`.

`varlen_attention` is the one entry point. Attention never crosses a document
boundary, so its cost is quadratic per document, not per micro-batch (the
cost model's a * sum(s_i^2) term). Two paths sit behind it:

- CUDA with fp16/bf16 (`flash_applies`): one varlen flash kernel call over
  the whole micro-batch, `torch.nn.attention.varlen.varlen_attn` where the
  installed torch has it, else `flash_attn` if installed.
- Everywhere else (CPU, fp32, CUDA without a varlen kernel): causal SDPA over
  each document's slice as a 4-D tensor, so that SDPA takes its fused flash
  kernel (3-D inputs take the math path, 3-7x slower on CPU; on CUDA with
  bf16 this is flash SDPA per document).

Split documents under CP attend blockwise (runtime/modeling/blockwise_attention.py),
with the flash kernels' LSE on CUDA and CPU alike.

Layout (as varlen flash kernels take it): q (T, Hq, D), k and v (T, Hkv, D)
with Hq a multiple of Hkv (GQA); the output is (T, Hq, D).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

import torch
import torch.nn.functional as F

Kernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]


def varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int
) -> torch.Tensor:
    """Causal attention within each document of the packed micro-batch."""
    if flash_applies(q.device, q.dtype, q.shape[-1]):
        kernel = _varlen_kernel()
        if kernel is not None:
            return kernel(q, k, v, cu_seqlens.to(device=q.device, dtype=torch.int32), max_seqlen)
    return per_document_attention(q, k, v, cu_seqlens)


def per_document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Causal SDPA on each document's slice; exact, and fastest on CPU."""
    bounds = cu_seqlens.tolist()
    outputs = [
        causal_sdpa(q[start:end], k[start:end], v[start:end])
        for start, end in zip(bounds[:-1], bounds[1:], strict=True)
        if end > start
    ]
    return torch.cat(outputs) if len(outputs) > 1 else outputs[0].contiguous()


def causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal SDPA on one document's rows, (s, H, D) in and out.

    SDPA's fused kernels (CPU flash among them) take only 4-D inputs; 3-D falls
    back to the math path, 3-7x slower on CPU. Hence the leading batch of one.
    """
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0),
        is_causal=True,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return out.squeeze(0).transpose(0, 1)


def attention_backend(device: torch.device | str, dtype: torch.dtype, head_dim: int = 128) -> str:
    """Which path `varlen_attention` takes for tensors of this device and dtype (for logs and benchmarks)."""
    if flash_applies(device, dtype, head_dim) and _varlen_kernel() is not None:
        return _varlen_kernel_name()
    return "sdpa-per-document"


def flash_applies(device: torch.device | str, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether CUDA flash kernels take these tensors: fp16/bf16 on CUDA, a head size a multiple of 8 up
    to 256 (elsewhere the callers take SDPA, which picks its own kernel, or the math path)."""
    return (
        torch.device(device).type == "cuda" and dtype in (torch.float16, torch.bfloat16)
        and head_dim % 8 == 0 and head_dim <= 256
    )


@functools.cache
def _varlen_kernel_name() -> str:
    return _find_varlen_kernel()[0]


@functools.cache
def _varlen_kernel() -> Kernel | None:
    return _find_varlen_kernel()[1]


def _find_varlen_kernel() -> tuple[str, Kernel | None]:
    """The installed varlen flash kernel, adapted to one signature; the API moved across torch releases."""
    try:
        from torch.nn.attention.varlen import varlen_attn  # type: ignore[import-not-found]
    except ImportError:
        varlen_attn = None
    if varlen_attn is not None:
        params = inspect.signature(varlen_attn).parameters
        causal = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
        native_gqa = "enable_gqa" in params

        def torch_varlen(q, k, v, cu, max_len):
            if k.shape[1] != q.shape[1]:
                if native_gqa:
                    return varlen_attn(q, k, v, cu, cu, max_len, max_len, enable_gqa=True, **causal)
                k, v = repeat_kv(k, q.shape[1]), repeat_kv(v, q.shape[1])
            return varlen_attn(q, k, v, cu, cu, max_len, max_len, **causal)

        return "torch-varlen-flash", torch_varlen
    try:
        from flash_attn import flash_attn_varlen_func  # type: ignore[import-not-found]
    except ImportError:
        return "sdpa-per-document", None

    def flash_attn_varlen(q, k, v, cu, max_len):
        # flash-attn handles GQA itself when Hq is a multiple of Hkv.
        return flash_attn_varlen_func(q, k, v, cu, cu, max_len, max_len, causal=True)

    return "flash-attn-varlen", flash_attn_varlen


def repeat_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    """Each K/V head repeated for its group of query heads (GQA), for kernels without native GQA.

    Heads are dim 1, in (rows, H, D) as in (1, H, rows, D).
    """
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)
