"""Per-head RMSNorm (Qwen3's q_norm / k_norm; Gemma's, with its weight offset from 1) plus
NeoX-style rotary, fused and in place.

The cos/sin cache is one tensor `[max_pos, head_dim]`: columns `[0, head_dim/2)` hold
cos(pos * inv_freq), columns `[head_dim/2, head_dim)` sin(pos * inv_freq). Rotation is HF's
rotate_half layout: x1 = x[:half], x2 = x[half:] -> (x1*cos - x2*sin, x2*cos + x1*sin).

On the Triton path the same program (one per token) can also write the token's rotated k and
its v into the paged KV cache, saving the attention backend's store kernel: one launch less
per layer and step.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from minivllm.worker.ops._triton import (
    next_power_of_2,
    pdl,
    tl,
    triton,
    use_triton,
    wait_for_producers,
)
from minivllm.worker.ops.kv_cache import FP8, kv_scale_arg, load_kv_scales, to_cache


def build_cos_sin_cache(
    max_pos: int,
    head_dim: int,
    rope_theta: float,
    dtype: torch.dtype,
    device: torch.device | str,
    rope_scaling: dict[str, Any] | None = None,
) -> torch.Tensor:
    """[max_pos, head_dim] cos|sin table, computed in float32 the way HF does, then cast.

    `rope_scaling` may be None / {"rope_type": "default"}, Llama 3.1's {"rope_type": "llama3",
    "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}, or
    {"rope_type": "linear", "factor"} (positions divided by the factor: Gemma 3's global
    layers).
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
    elif rope_type == "linear":
        assert rope_scaling is not None
        inv_freq = inv_freq / float(rope_scaling["factor"])
    elif rope_type != "default":
        raise ValueError(f"rope_type {rope_type!r} is not supported (default, llama3, linear)")
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(dtype=dtype, device=device)


@triton.jit
def _norm_rope_heads(
    x_ptr, stride_h, n_heads, w_ptr, cos, sin, eps,
    BLOCK_H: tl.constexpr, HALF: tl.constexpr, APPLY_NORM: tl.constexpr,
    NORM_OFFSET: tl.constexpr,
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
        if NORM_OFFSET:  # Gemma's: times 1 + w in float32, rounded once
            x1 = (x1 * rstd * (1.0 + w1)).to(dtype).to(tl.float32)
            x2 = (x2 * rstd * (1.0 + w2)).to(dtype).to(tl.float32)
        else:  # rounded to the activation dtype twice, as HF's RMSNorm does
            x1 = ((x1 * rstd).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
            x2 = ((x2 * rstd).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
    y1 = (x1 * cos - x2 * sin).to(dtype)
    y2 = (x2 * cos + x1 * sin).to(dtype)
    tl.store(ptrs, y1, mask=mask)
    tl.store(ptrs + HALF, y2, mask=mask)
    return y1, y2


@triton.jit(do_not_specialize=["n_slots"])  # one variant for every batch size
def _qk_norm_rope_kernel(
    q_ptr, k_ptr, q_w_ptr, k_w_ptr, cache_ptr, pos_ptr,
    stride_q_tok, stride_q_head, stride_k_tok, stride_k_head, stride_cache, n_q_heads,
    n_k_heads, eps,
    v_ptr, kv_ptr, slot_ptr, kv_scale_ptr, n_slots, stride_v_tok, stride_v_head,
    stride_c_kv, stride_c_blk, stride_c_pos, stride_c_head,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, HALF: tl.constexpr,
    APPLY_NORM: tl.constexpr, STORE_KV: tl.constexpr, PAGE: tl.constexpr,
    FP8: tl.constexpr = False, NORM_OFFSET: tl.constexpr = False, PDL: tl.constexpr = False,
):  # fmt: skip
    wait_for_producers(PDL)
    tok = tl.program_id(0)
    pos = tl.load(pos_ptr + tok)
    offs_d = tl.arange(0, HALF)
    cos = tl.load(cache_ptr + pos * stride_cache + offs_d).to(tl.float32)[None, :]
    sin = tl.load(cache_ptr + pos * stride_cache + HALF + offs_d).to(tl.float32)[None, :]
    _norm_rope_heads(
        q_ptr + tok * stride_q_tok, stride_q_head, n_q_heads, q_w_ptr, cos, sin, eps,
        BLOCK_HQ, HALF, APPLY_NORM, NORM_OFFSET,
    )  # fmt: skip
    k1, k2 = _norm_rope_heads(
        k_ptr + tok * stride_k_tok, stride_k_head, n_k_heads, k_w_ptr, cos, sin, eps,
        BLOCK_HK, HALF, APPLY_NORM, NORM_OFFSET,
    )  # fmt: skip
    if STORE_KV:
        # rows past the slot mapping (padding) and slot -1 are not stored
        slot = tl.load(slot_ptr + tok, mask=tok < n_slots, other=-1)
        if slot >= 0:
            offs_h = tl.arange(0, BLOCK_HK)
            mask = (offs_h < n_k_heads)[:, None]
            dst = kv_ptr + (slot // PAGE) * stride_c_blk + (slot % PAGE) * stride_c_pos
            dst += offs_h[:, None] * stride_c_head + offs_d[None, :]
            src = v_ptr + tok * stride_v_tok + offs_h[:, None] * stride_v_head + offs_d[None, :]
            v1 = tl.load(src, mask=mask)
            v2 = tl.load(src + HALF, mask=mask)
            ty = kv_ptr.dtype.element_ty
            k_scale, v_scale = load_kv_scales(kv_scale_ptr, FP8)
            tl.store(dst, to_cache(k1, k_scale, FP8, ty), mask=mask)
            tl.store(dst + HALF, to_cache(k2, k_scale, FP8, ty), mask=mask)
            tl.store(dst + stride_c_kv, to_cache(v1, v_scale, FP8, ty), mask=mask)
            tl.store(dst + stride_c_kv + HALF, to_cache(v2, v_scale, FP8, ty), mask=mask)


def qk_norm_rope_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    q_norm_w: torch.Tensor | None,
    k_norm_w: torch.Tensor | None,
    cos_sin_cache: torch.Tensor,
    positions: torch.Tensor,
    eps: float,
    apply_norm: bool,
    norm_offset: bool = False,
) -> None:
    cos, sin = cos_sin_cache[positions].float().unsqueeze(1).chunk(2, dim=-1)
    for x, w in ((q, q_norm_w), (k, k_norm_w)):
        x32 = x.float()
        if apply_norm:
            assert w is not None
            x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
            if norm_offset:
                x32 = (x32 * (1.0 + w.float())).to(x.dtype).float()
            else:
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
    v: torch.Tensor | None = None,
    kv_cache: torch.Tensor | None = None,
    slot_mapping: torch.Tensor | None = None,
    kv_scale: torch.Tensor | None = None,
    norm_offset: bool = False,
) -> None:
    """In place on q [T, Hq, D] and k [T, Hkv, D] (views with unit last stride are fine):
    optional per-head RMSNorm with weights [D] (`norm_offset`: Gemma's, times 1 + w), then
    rotary at `positions` [T] (int64).

    With `v` [T, Hkv, D], `kv_cache` [2, num_blocks, block_size, Hkv, D] and `slot_mapping`
    (int64, one flat slot per token; -1, and rows past its end, are not stored), token t's
    rotated k and its v also go into the cache at slot `slot_mapping[t]`, in the cache's
    dtype, as the attention backends' own store would write them (an FP8 cache divides by
    `kv_scale` [2], see ops/kv_cache.py). Only the Triton path stores (it reads the
    slots on the device, so it is CUDA-graph safe); asking the torch fallback is an error."""
    head_dim = q.shape[-1]
    if head_dim % 2 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two, got {head_dim}")
    fuse_store = kv_cache is not None
    if fuse_store != (v is not None) or fuse_store != (slot_mapping is not None):
        raise ValueError("v, kv_cache and slot_mapping come together")
    if not use_triton(q):
        if fuse_store:
            raise ValueError("the KV store is fused only into the Triton kernel")
        qk_norm_rope_torch(
            q, k, q_norm_w, k_norm_w, cos_sin_cache, positions, eps, apply_norm, norm_offset
        )
        return
    assert q.stride(-1) == k.stride(-1) == cos_sin_cache.stride(-1) == 1
    q_w = q_norm_w if apply_norm else cos_sin_cache  # dummies when the norm is off
    k_w = k_norm_w if apply_norm else cos_sin_cache
    if fuse_store:
        assert v is not None and kv_cache is not None and slot_mapping is not None
        if v.shape != k.shape or kv_cache.shape[-2:] != k.shape[-2:]:
            raise ValueError(
                f"v {tuple(v.shape)} and kv_cache {tuple(kv_cache.shape)} do not match "
                f"k {tuple(k.shape)}"
            )
        assert v.stride(-1) == kv_cache.stride(-1) == 1
        fp8 = kv_cache.dtype == FP8
        scale = kv_scale_arg(kv_scale, fp8, v)
        v_args = (v, kv_cache, slot_mapping, scale, slot_mapping.numel(), *v.stride()[:2])
        cache_strides, page = kv_cache.stride()[:4], kv_cache.shape[2]
    else:  # dummies, never read
        fp8, v_args, cache_strides, page = False, (k, k, positions, k, 0, 0, 0), (0, 0, 0, 0), 1
    _qk_norm_rope_kernel[(q.shape[0],)](
        q, k, q_w, k_w, cos_sin_cache, positions,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
        q.shape[1], k.shape[1], eps, *v_args, *cache_strides,
        BLOCK_HQ=next_power_of_2(q.shape[1]), BLOCK_HK=next_power_of_2(k.shape[1]),
        HALF=head_dim // 2, APPLY_NORM=apply_norm, STORE_KV=fuse_store, PAGE=page, FP8=fp8,
        NORM_OFFSET=norm_offset, **pdl(q),
    )  # fmt: skip
