"""Per-head RMSNorm (Qwen3's q_norm / k_norm; Gemma's, with its weight offset from 1) plus
NeoX-style rotary, fused and in place.

The cos/sin cache is one tensor `[rows, rotary_dim]`: columns `[0, rotary_dim/2)` hold
cos(pos * inv_freq), columns `[rotary_dim/2, rotary_dim)` sin(pos * inv_freq), each times the
scaling's attention factor (YaRN, LongRoPE), as transformers multiplies its cos and sin.
Rotation is HF's rotate_half layout over the first `rotary_dim` dims of each head: x1 =
x[:half], x2 = x[half:rotary_dim] -> (x1*cos - x2*sin, x2*cos + x1*sin); the dims past
`rotary_dim` (partial rotary, Phi-4-mini's) pass through.

On the Triton path the same program (one per token) can also write the token's rotated k and
its v into the paged KV cache, saving the attention backend's store kernel: one launch less
per layer and step.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from minivllm.rope_config import SUPPORTED_ROPE_TYPES
from minivllm.worker.ops._triton import (
    next_power_of_2,
    pdl,
    tl,
    triton,
    use_triton,
    wait_for_producers,
)
from minivllm.worker.ops.kv_cache import FP8, kv_scale_arg, load_kv_scales, to_cache


def _inv_freq(rotary_dim: int, rope_theta: float) -> torch.Tensor:
    return 1.0 / (
        rope_theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim)
    )


def _llama3_inv_freq(inv_freq: torch.Tensor, rope: dict[str, Any]) -> torch.Tensor:
    factor = float(rope["factor"])
    low, high = float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
    old_len = float(rope["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(
    rotary_dim: int, theta: float, rope: dict[str, Any]
) -> tuple[torch.Tensor, float]:
    """YaRN's frequencies and attention factor, computed as transformers computes them:
    interpolated (divided by the factor) below the beta_slow rotations over the original
    length, kept above beta_fast, blended linearly between."""
    factor, original = float(rope["factor"]), rope["original_max_position_embeddings"]

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = rope.get("attention_factor")
    if attention is None:
        m, m_all = rope.get("mscale"), rope.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast, beta_slow = rope.get("beta_fast") or 32, rope.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return rotary_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # no division by zero
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep, float(attention)


def _longrope_inv_freq(rotary_dim: int, theta: float, ext_factors: list[float]) -> torch.Tensor:
    ext = torch.tensor(ext_factors, dtype=torch.float32)
    if ext.numel() != rotary_dim // 2:
        raise ValueError(
            f"longrope factors: {ext.numel()} given, the rotary dim {rotary_dim} needs "
            f"{rotary_dim // 2}"
        )
    shape = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    return 1.0 / (ext * theta**shape)


def _table(num_pos: int, inv_freq: torch.Tensor, attention_factor: float = 1.0) -> torch.Tensor:
    freqs = torch.outer(torch.arange(num_pos, dtype=torch.float32), inv_freq)
    return torch.cat([freqs.cos() * attention_factor, freqs.sin() * attention_factor], dim=-1)


def build_cos_sin_cache(
    max_pos: int,
    rotary_dim: int,
    rope_theta: float,
    dtype: torch.dtype,
    device: torch.device | str,
    rope_scaling: dict[str, Any] | None = None,
) -> torch.Tensor:
    """[rows, rotary_dim] cos|sin table for positions [0, max_pos), computed in float32 the
    way transformers does, then cast.

    `rope_scaling` is `rope_config.rope_parameters`' dict (None: default): "default";
    "linear" (frequencies divided by `factor`); "dynamic" (transformers' NTK rescaling starts
    past max_position_embeddings, which max_model_len does not pass: the default table);
    Llama 3.1's "llama3"; "yarn" (with its attention factor); "longrope" (Phi-3): the
    short factors' rows for [0, original_max_position_embeddings), then, if max_pos is
    longer, the long factors' rows for [0, max_pos) — a sequence longer than the original
    length reads row `position + original_max_position_embeddings` (see
    `rope_config.long_rope_threshold`). Both carry the attention factor.
    """
    rope = rope_scaling or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    inv_freq = _inv_freq(rotary_dim, rope_theta)
    if rope_type in ("default", "dynamic"):
        table = _table(max_pos, inv_freq)
    elif rope_type == "linear":
        table = _table(max_pos, inv_freq / float(rope["factor"]))
    elif rope_type == "llama3":
        table = _table(max_pos, _llama3_inv_freq(inv_freq, rope))
    elif rope_type == "yarn":
        table = _table(max_pos, *_yarn_inv_freq(rotary_dim, rope_theta, rope))
    elif rope_type == "longrope":
        original = rope["original_max_position_embeddings"]
        factor = float(rope["factor"])
        attention = rope.get("attention_factor")
        if attention is None:
            attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
        short = _longrope_inv_freq(rotary_dim, rope_theta, rope["short_factor"])
        table = _table(min(max_pos, original), short, attention)
        if max_pos > original:
            long = _longrope_inv_freq(rotary_dim, rope_theta, rope["long_factor"])
            table = torch.cat([table, _table(max_pos, long, attention)])
    else:
        raise ValueError(
            f"rope_type {rope_type!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    return table.to(dtype=dtype, device=device)


@triton.jit
def _norm_rope_heads(
    x_ptr, stride_h, n_heads, w_ptr, cos, sin, eps,
    BLOCK_H: tl.constexpr, HALF: tl.constexpr, BLOCK_R: tl.constexpr, PASS: tl.constexpr,
    BLOCK_P: tl.constexpr, APPLY_NORM: tl.constexpr, NORM_OFFSET: tl.constexpr,
):  # fmt: skip
    """Norms (optionally) and rotates the heads of one token in place: dims [0, HALF) and
    [HALF, 2 HALF) rotate, the PASS dims after them pass through (normed). Returns the three
    parts as stored (BLOCK_R, BLOCK_R and BLOCK_P wide, masked past HALF and PASS)."""
    offs_h = tl.arange(0, BLOCK_H)
    offs_r = tl.arange(0, BLOCK_R)
    offs_p = tl.arange(0, BLOCK_P)
    heads = (offs_h < n_heads)[:, None]
    mask_r = heads & (offs_r < HALF)[None, :]
    mask_p = heads & (offs_p < PASS)[None, :]
    ptrs = x_ptr + offs_h[:, None] * stride_h + offs_r[None, :]
    pass_ptrs = x_ptr + offs_h[:, None] * stride_h + 2 * HALF + offs_p[None, :]
    x1 = tl.load(ptrs, mask=mask_r, other=0.0)
    x2 = tl.load(ptrs + HALF, mask=mask_r, other=0.0)
    dtype = x1.dtype
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    xp = tl.load(pass_ptrs, mask=mask_p, other=0.0).to(tl.float32)  # PASS 0: nothing read
    if APPLY_NORM:
        squares = tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1) + tl.sum(xp * xp, 1)
        rstd = tl.rsqrt(squares / (2 * HALF + PASS) + eps)[:, None]
        w1 = tl.load(w_ptr + offs_r, mask=offs_r < HALF, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + HALF + offs_r, mask=offs_r < HALF, other=0.0).to(tl.float32)[None, :]
        wp = tl.load(w_ptr + 2 * HALF + offs_p, mask=offs_p < PASS, other=0.0)
        wp = wp.to(tl.float32)[None, :]
        if NORM_OFFSET:  # Gemma's: times 1 + w in float32, rounded once
            x1 = (x1 * rstd * (1.0 + w1)).to(dtype).to(tl.float32)
            x2 = (x2 * rstd * (1.0 + w2)).to(dtype).to(tl.float32)
            xp = (xp * rstd * (1.0 + wp)).to(dtype).to(tl.float32)
        else:  # rounded to the activation dtype twice, as HF's RMSNorm does
            x1 = ((x1 * rstd).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
            x2 = ((x2 * rstd).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
            xp = ((xp * rstd).to(dtype).to(tl.float32) * wp).to(dtype).to(tl.float32)
    y1 = (x1 * cos - x2 * sin).to(dtype)
    y2 = (x2 * cos + x1 * sin).to(dtype)
    yp = xp.to(dtype)
    tl.store(ptrs, y1, mask=mask_r)
    tl.store(ptrs + HALF, y2, mask=mask_r)
    if APPLY_NORM:  # else the pass-through dims are as they were
        tl.store(pass_ptrs, yp, mask=mask_p)
    return y1, y2, yp


@triton.jit(do_not_specialize=["n_slots"])  # one variant for every batch size
def _qk_norm_rope_kernel(
    q_ptr, k_ptr, q_w_ptr, k_w_ptr, cache_ptr, pos_ptr,
    stride_q_tok, stride_q_head, stride_k_tok, stride_k_head, stride_cache, n_q_heads,
    n_k_heads, eps,
    v_ptr, kv_ptr, slot_ptr, kv_scale_ptr, n_slots, stride_v_tok, stride_v_head,
    stride_c_kv, stride_c_blk, stride_c_pos, stride_c_head,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, HALF: tl.constexpr, BLOCK_R: tl.constexpr,
    PASS: tl.constexpr, BLOCK_P: tl.constexpr,
    APPLY_NORM: tl.constexpr, STORE_KV: tl.constexpr, PAGE: tl.constexpr,
    FP8: tl.constexpr = False, NORM_OFFSET: tl.constexpr = False, PDL: tl.constexpr = False,
):  # fmt: skip
    wait_for_producers(PDL)
    tok = tl.program_id(0)
    pos = tl.load(pos_ptr + tok)
    offs_r = tl.arange(0, BLOCK_R)
    cos = tl.load(cache_ptr + pos * stride_cache + offs_r, mask=offs_r < HALF, other=0.0)
    sin = tl.load(cache_ptr + pos * stride_cache + HALF + offs_r, mask=offs_r < HALF, other=0.0)
    cos = cos.to(tl.float32)[None, :]
    sin = sin.to(tl.float32)[None, :]
    _norm_rope_heads(
        q_ptr + tok * stride_q_tok, stride_q_head, n_q_heads, q_w_ptr, cos, sin, eps,
        BLOCK_HQ, HALF, BLOCK_R, PASS, BLOCK_P, APPLY_NORM, NORM_OFFSET,
    )  # fmt: skip
    k1, k2, kp = _norm_rope_heads(
        k_ptr + tok * stride_k_tok, stride_k_head, n_k_heads, k_w_ptr, cos, sin, eps,
        BLOCK_HK, HALF, BLOCK_R, PASS, BLOCK_P, APPLY_NORM, NORM_OFFSET,
    )  # fmt: skip
    if STORE_KV:
        # rows past the slot mapping (padding) and slot -1 are not stored
        slot = tl.load(slot_ptr + tok, mask=tok < n_slots, other=-1)
        if slot >= 0:
            offs_h = tl.arange(0, BLOCK_HK)
            offs_p = tl.arange(0, BLOCK_P)
            heads = (offs_h < n_k_heads)[:, None]
            mask_r = heads & (offs_r < HALF)[None, :]
            mask_p = heads & (offs_p < PASS)[None, :]
            dst = kv_ptr + (slot // PAGE) * stride_c_blk + (slot % PAGE) * stride_c_pos
            dst += offs_h[:, None] * stride_c_head
            src = v_ptr + tok * stride_v_tok + offs_h[:, None] * stride_v_head
            v1 = tl.load(src + offs_r[None, :], mask=mask_r)
            v2 = tl.load(src + HALF + offs_r[None, :], mask=mask_r)
            vp = tl.load(src + 2 * HALF + offs_p[None, :], mask=mask_p)
            ty = kv_ptr.dtype.element_ty
            k_scale, v_scale = load_kv_scales(kv_scale_ptr, FP8)
            r_dst, p_dst = dst + offs_r[None, :], dst + 2 * HALF + offs_p[None, :]
            tl.store(r_dst, to_cache(k1, k_scale, FP8, ty), mask=mask_r)
            tl.store(r_dst + HALF, to_cache(k2, k_scale, FP8, ty), mask=mask_r)
            tl.store(p_dst, to_cache(kp, k_scale, FP8, ty), mask=mask_p)
            tl.store(r_dst + stride_c_kv, to_cache(v1, v_scale, FP8, ty), mask=mask_r)
            tl.store(r_dst + stride_c_kv + HALF, to_cache(v2, v_scale, FP8, ty), mask=mask_r)
            tl.store(p_dst + stride_c_kv, to_cache(vp, v_scale, FP8, ty), mask=mask_p)


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
    rot = cos_sin_cache.shape[-1]
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
        x1, x2 = x32[..., :rot].chunk(2, dim=-1)
        x.copy_(torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x32[..., rot:]], dim=-1))


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
    rotary at `positions` [T] (int64; the rows of `cos_sin_cache`) over the first
    `cos_sin_cache.shape[-1]` dims of each head (the rotary dim; the dims after it pass
    through).

    With `v` [T, Hkv, D], `kv_cache` [2, num_blocks, block_size, Hkv, D] and `slot_mapping`
    (int64, one flat slot per token; -1, and rows past its end, are not stored), token t's
    rotated k and its v also go into the cache at slot `slot_mapping[t]`, in the cache's
    dtype, as the attention backends' own store would write them (an FP8 cache divides by
    `kv_scale` [2], see ops/kv_cache.py). Only the Triton path stores (it reads the
    slots on the device, so it is CUDA-graph safe); asking the torch fallback is an error."""
    head_dim, rot = q.shape[-1], cos_sin_cache.shape[-1]
    if rot % 2 or not 0 < rot <= head_dim:
        raise ValueError(f"rotary dim {rot} must be even and at most head_dim {head_dim}")
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
    half, pass_dims = rot // 2, head_dim - rot
    _qk_norm_rope_kernel[(q.shape[0],)](
        q, k, q_w, k_w, cos_sin_cache, positions,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
        q.shape[1], k.shape[1], eps, *v_args, *cache_strides,
        BLOCK_HQ=next_power_of_2(q.shape[1]), BLOCK_HK=next_power_of_2(k.shape[1]),
        HALF=half, BLOCK_R=next_power_of_2(half), PASS=pass_dims,
        BLOCK_P=next_power_of_2(max(pass_dims, 1)), APPLY_NORM=apply_norm, STORE_KV=fuse_store,
        PAGE=page, FP8=fp8, NORM_OFFSET=norm_offset, **pdl(q),
    )  # fmt: skip
