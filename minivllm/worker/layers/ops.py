"""The ops the layers call, as plain torch functions.

They are the swap point for fused kernels: on CUDA tensors the norms and the activation go
to the Triton kernels in `minivllm.worker.ops` (one kernel each instead of 3-6 small ones),
and single-row linears to the Triton GEMV; on the CPU they stay the plain torch below. Each
computes in float32 and returns the input dtype, matching HF transformers' numerics.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minivllm.worker.ops import activation as _triton_activation
from minivllm.worker.ops import gemv as _triton_gemv
from minivllm.worker.ops import norm as _triton_norm
from minivllm.worker.ops._triton import HAS_TRITON


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T + b. One 16-bit row on CUDA (batch-1 decode) goes to the Triton GEMV, which
    reads W at 1.2-2 TB/s where cuBLAS's 8-row GEMM tiles get less (19 against 25 µs per
    Qwen3-0.6B layer on an H100); everything else is cuBLAS."""
    if (
        bias is None
        and HAS_TRITON
        and x.is_cuda
        and x.dim() == 2
        and x.shape[0] == 1
        and x.dtype in (torch.bfloat16, torch.float16)
        and x.stride(1) == 1
        and weight.stride(1) == 1
    ):
        cfg = _triton_gemv.gemv_config(*weight.shape)
        if cfg is not None:
            return _triton_gemv.gemv(x, weight, cfg)
    return F.linear(x, weight, bias)


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
