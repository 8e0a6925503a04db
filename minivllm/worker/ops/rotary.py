"""Per-head RMSNorm (Qwen3's q_norm / k_norm) plus NeoX-style rotary, fused and in place.

The cos/sin cache is one tensor `[max_pos, head_dim]`: columns `[0, head_dim/2)` hold
cos(pos * inv_freq), columns `[head_dim/2, head_dim)` sin(pos * inv_freq). Rotation is HF's
rotate_half layout: x1 = x[:half], x2 = x[half:] -> (x1*cos - x2*sin, x2*cos + x1*sin).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from minivllm.worker.ops._triton import next_power_of_2, tl, triton, use_triton


def build_cos_sin_cache(
    max_pos: int,
    head_dim: int,
    rope_theta: float,
    dtype: torch.dtype,
    device: torch.device | str,
    rope_scaling: dict[str, Any] | None = None,
) -> torch.Tensor:
    """[max_pos, head_dim] cos|sin table, computed in float32 the way HF does, then cast.

    `rope_scaling` may be None / {"rope_type": "default"} or Llama 3.1's {"rope_type": "llama3",
    "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}.
    """
    inv_freq = 1.0 / (
        rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    )
    rope_type = (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type", "default"))
    if rope_type == "llama3":
        assert rope_scaling is not None
        factor = float(rope_scaling["factor"])
        low, high = float(rope_scaling["low_freq_factor"]), float(rope_scaling["high_freq_factor"])
        old_len = float(rope_scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        inv_freq = torch.where(is_medium, smoothed, scaled)
    elif rope_type != "default":
        raise ValueError(f"rope_type {rope_type!r} is not supported (default, llama3)")
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(dtype=dtype, device=device)


@triton.jit
def _norm_rope_heads(
    x_ptr, stride_h, n_heads, w_ptr, cos, sin, eps,
    BLOCK_H: tl.constexpr, HALF: tl.constexpr, APPLY_NORM: tl.constexpr,
):  # fmt: skip
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HALF)
    mask = (offs_h < n_heads)[:, None]
    ptrs = x_ptr + offs_h[:, None] * stride_h + offs_d[None, :]
    x1 = tl.load(ptrs, mask=mask, other=0.0)
    x2 = tl.load(ptrs + HALF, mask=mask, other=0.0)
    dtype = x1.dtype
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    if APPLY_NORM:
        rstd = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF) + eps)[:, None]
        w1 = tl.load(w_ptr + offs_d).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + HALF + offs_d).to(tl.float32)[None, :]
        # rounded to the activation dtype twice, as HF's RMSNorm does
        x1 = ((x1 * rstd).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
        x2 = ((x2 * rstd).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
    tl.store(ptrs, (x1 * cos - x2 * sin).to(dtype), mask=mask)
    tl.store(ptrs + HALF, (x2 * cos + x1 * sin).to(dtype), mask=mask)


@triton.jit
def _qk_norm_rope_kernel(
    q_ptr, k_ptr, q_w_ptr, k_w_ptr, cache_ptr, pos_ptr,
    stride_q_tok, stride_q_head, stride_k_tok, stride_k_head, stride_cache, n_q_heads,
    n_k_heads, eps,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, HALF: tl.constexpr,
    APPLY_NORM: tl.constexpr,
):  # fmt: skip
    tok = tl.program_id(0)
    pos = tl.load(pos_ptr + tok)
    offs_d = tl.arange(0, HALF)
    cos = tl.load(cache_ptr + pos * stride_cache + offs_d).to(tl.float32)[None, :]
    sin = tl.load(cache_ptr + pos * stride_cache + HALF + offs_d).to(tl.float32)[None, :]
    _norm_rope_heads(
        q_ptr + tok * stride_q_tok, stride_q_head, n_q_heads, q_w_ptr, cos, sin, eps,
        BLOCK_HQ, HALF, APPLY_NORM,
    )  # fmt: skip
    _norm_rope_heads(
        k_ptr + tok * stride_k_tok, stride_k_head, n_k_heads, k_w_ptr, cos, sin, eps,
        BLOCK_HK, HALF, APPLY_NORM,
    )  # fmt: skip


def qk_norm_rope_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    q_norm_w: torch.Tensor | None,
    k_norm_w: torch.Tensor | None,
    cos_sin_cache: torch.Tensor,
    positions: torch.Tensor,
    eps: float,
    apply_norm: bool,
) -> None:
    cos, sin = cos_sin_cache[positions].float().unsqueeze(1).chunk(2, dim=-1)
    for x, w in ((q, q_norm_w), (k, k_norm_w)):
        x32 = x.float()
        if apply_norm:
            assert w is not None
            x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
            x32 = (w * x32.to(x.dtype)).float()
        x1, x2 = x32.chunk(2, dim=-1)
        x.copy_(torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1))


def qk_norm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    q_norm_w: torch.Tensor | None,
    k_norm_w: torch.Tensor | None,
    cos_sin_cache: torch.Tensor,
    positions: torch.Tensor,
    eps: float,
    apply_norm: bool,
) -> None:
    """In place on q [T, Hq, D] and k [T, Hkv, D] (views with unit last stride are fine):
    optional per-head RMSNorm with weights [D], then rotary at `positions` [T] (int64)."""
    head_dim = q.shape[-1]
    if head_dim % 2 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two, got {head_dim}")
    if not use_triton(q):
        qk_norm_rope_torch(q, k, q_norm_w, k_norm_w, cos_sin_cache, positions, eps, apply_norm)
        return
    assert q.stride(-1) == k.stride(-1) == cos_sin_cache.stride(-1) == 1
    q_w = q_norm_w if apply_norm else cos_sin_cache  # dummies when the norm is off
    k_w = k_norm_w if apply_norm else cos_sin_cache
    _qk_norm_rope_kernel[(q.shape[0],)](
        q, k, q_w, k_w, cos_sin_cache, positions,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
        q.shape[1], k.shape[1], eps,
        BLOCK_HQ=next_power_of_2(q.shape[1]), BLOCK_HK=next_power_of_2(k.shape[1]),
        HALF=head_dim // 2, APPLY_NORM=apply_norm,
    )  # fmt: skip
