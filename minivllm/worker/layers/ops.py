"""The ops the layers call, as plain torch functions.

They are the swap point for fused kernels: on CUDA tensors the norms and the activation go
to the Triton kernels in `minivllm.worker.ops` (one kernel each instead of 3-6 small ones),
and single-row linears to the Triton GEMV, which also absorbs the norm or the activation in
front of it; on the CPU they stay the plain torch below. Each computes in float32 and
returns the input dtype, matching HF transformers' numerics.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minivllm.worker.ops import activation as _triton_activation
from minivllm.worker.ops import gemv as _triton_gemv
from minivllm.worker.ops import norm as _triton_norm
from minivllm.worker.ops._triton import HAS_TRITON


def _gemv_config(x: torch.Tensor, weight: torch.Tensor, k: int) -> _triton_gemv.GemvConfig | None:
    """The GEMV config for x [1, *] @ weight^T when the Triton GEMV takes it, else None: one
    16-bit CUDA row (batch-1 decode), where it reads W at 1.2-2 TB/s and cuBLAS's 8-row GEMM
    tiles get less (19 against 25 µs per Qwen3-0.6B layer on an H100)."""
    if not (
        HAS_TRITON
        and x.is_cuda
        and x.dim() == 2
        and x.shape[0] == 1
        and x.dtype in (torch.bfloat16, torch.float16)
        and x.stride(1) == 1
        and weight.stride(1) == 1
        and weight.shape[1] == k
    ):
        return None
    return _triton_gemv.gemv_config(weight.shape[0], k)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T + b: the Triton GEMV for one row on CUDA, cuBLAS (or the CPU) otherwise."""
    cfg = _gemv_config(x, weight, x.shape[-1]) if bias is None else None
    if cfg is not None:
        return _triton_gemv.gemv(x, weight, cfg)
    return F.linear(x, weight, bias)


def rms_norm_linear(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(linear(rms_norm(x + residual)), x + residual); without a residual (linear(rms_norm(x)),
    x). One kernel for a single row on CUDA (the norm is the GEMV's prologue)."""
    cfg = _gemv_config(x, weight, x.shape[-1]) if bias is None else None
    if cfg is not None and (residual is None or (x.is_contiguous() and residual.is_contiguous())):
        return _triton_gemv.gemv_rms_norm(x, residual, norm_weight, eps, weight, cfg)
    normed, residual = add_rms_norm(x, residual, norm_weight, eps)
    return linear(normed, weight, bias), residual


def silu_mul_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """linear(silu(x[..., :d]) * x[..., d:]); one kernel for a single row on CUDA."""
    cfg = _gemv_config(x, weight, x.shape[-1] // 2) if bias is None else None
    if cfg is not None:
        return _triton_gemv.gemv_silu_mul(x, weight, cfg)
    return linear(silu_and_mul(x), weight, bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * weight over the last dimension."""
    if HAS_TRITON and x.is_cuda:
        return _triton_norm.rms_norm(x, weight, eps)
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual): the new residual stream and its norm."""
    if HAS_TRITON and x.is_cuda:
        return _triton_norm.fused_add_rms_norm(x, residual, weight, eps)
    residual = x + residual
    return rms_norm(residual, weight, eps), residual


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`fused_add_rms_norm`, or without a residual (rms_norm(x), x): a decoder's norm and
    the residual stream after it, whether or not a stream exists yet."""
    if residual is None:
        return rms_norm(x, weight, eps), x
    return fused_add_rms_norm(x, residual, weight, eps)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[..., :d]) * x[..., d:] where the last dimension is 2 * d."""
    if HAS_TRITON and x.is_cuda:
        return _triton_activation.silu_and_mul(x)
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """NeoX-style rotary embedding (HF's rotate_half).

    q: [T, num_heads, head_dim], k: [T, num_kv_heads, head_dim];
    cos, sin: [T, head_dim // 2] float32 for each token's position.
    """
    cos = torch.cat((cos, cos), dim=-1).unsqueeze(1)
    sin = torch.cat((sin, sin), dim=-1).unsqueeze(1)
    q32, k32 = q.float(), k.float()
    q_out = q32 * cos + _rotate_half(q32) * sin
    k_out = k32 * cos + _rotate_half(k32) * sin
    return q_out.to(q.dtype), k_out.to(k.dtype)
