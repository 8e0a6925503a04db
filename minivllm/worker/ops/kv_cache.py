"""Writing the paged KV cache: its element type, the FP8 arithmetic every backend follows,
and the Triton store kernel.

With `kv_cache_dtype="fp8"` (or its alias "fp8_e4m3") each layer's cache holds e4m3 values
and the layer has two float32 scales, `kv_scale = [k_scale, v_scale]`, on the device:

    stored = e4m3(clamp(x / scale, -448, 448))      (round to nearest even)
    read   = float(stored) * scale

The Triton kernels do exactly this in registers; the torch functions here are the reference
the CPU backends run and the tests compare against. The kernels fold the key scale into the
softmax scale and the value scale into the final normalisation, so a read costs one
conversion per element.

Where the scales come from: attention/kv_scales.py. A 16-bit cache ignores them.
"""

from __future__ import annotations

import torch

from minivllm.worker.ops._triton import (
    next_power_of_2,
    pdl,
    tl,
    triton,
    use_triton,
    wait_for_producers,
)

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
K_SCALE_RANGE = 200.0
V_SCALE_RANGE = 100.0


def cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype of the KV cache for an `EngineArgs.kv_cache_dtype`."""
    return model_dtype if kv_cache_dtype == "auto" else FP8


def to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """x (already divided by its scale) saturated at +-448 and rounded to e4m3 (nearest
    even), as every FP8 kernel here rounds what it quantizes."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8)


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x as a cache of `dtype` stores it (`scale`: a scalar tensor, used only for FP8)."""
    if dtype != FP8:
        return x.to(dtype)
    return to_e4m3(x.float() / scale)


def dequantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Values read from a cache, in `dtype` (FP8 ones multiplied by `scale` in float32)."""
    if x.dtype != FP8:
        return x.to(dtype)
    return (x.float() * scale).to(dtype)


def calculate_kv_scales(k: torch.Tensor, v: torch.Tensor, kv_scale: torch.Tensor) -> None:
    """Set `kv_scale` [2] from this step's keys and values (vLLM's `calculate_kv_scales`).
    An all-zero tensor keeps the scale 1.0. Runs on the device, without a host sync."""
    amax = torch.stack([k.abs().amax(), v.abs().amax()]).float()
    scales = amax / torch.tensor([K_SCALE_RANGE, V_SCALE_RANGE], device=amax.device)
    kv_scale.copy_(torch.where(scales > 0, scales, torch.ones_like(scales)))


@triton.jit
def to_cache(x, scale, FP8: tl.constexpr, ty: tl.constexpr):
    """x as a cache of element type `ty` stores it (`quantize` in a kernel); `scale` is
    read only for FP8. Exact division and an explicit clamp, so the GPU's saturating
    conversion and torch's agree bit for bit."""
    if FP8:
        x = tl.clamp(tl.div_rn(x.to(tl.float32), scale), -448.0, 448.0)  # FP8_MAX
    return x.to(ty)


@triton.jit
def load_kv_scales(kv_scale_ptr, FP8: tl.constexpr):
    """(k_scale, v_scale) of an FP8 cache from its float32 [2] tensor; 1.0, 1.0 otherwise."""
    k_scale = 1.0
    v_scale = 1.0
    if FP8:
        k_scale = tl.load(kv_scale_ptr)
        v_scale = tl.load(kv_scale_ptr + 1)
    return k_scale, v_scale


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, cache_ptr, slot_ptr, kv_scale_ptr,
    stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
    stride_c_kv, stride_c_blk, stride_c_pos, stride_c_head,
    NUM_KV_HEADS: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr, FP8: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    wait_for_producers(PDL)
    tok = tl.program_id(0)
    slot = tl.load(slot_ptr + tok)
    if slot < 0:
        return
    k_scale, v_scale = load_kv_scales(kv_scale_ptr, FP8)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_DIM)
    mask = (offs_h < NUM_KV_HEADS)[:, None]
    src = offs_h[:, None] * stride_k_head + offs_d[None, :]
    k = tl.load(k_ptr + tok * stride_k_tok + src, mask=mask)
    src = offs_h[:, None] * stride_v_head + offs_d[None, :]
    v = tl.load(v_ptr + tok * stride_v_tok + src, mask=mask)
    dst = cache_ptr + (slot // PAGE) * stride_c_blk + (slot % PAGE) * stride_c_pos
    dst += offs_h[:, None] * stride_c_head + offs_d[None, :]
    ty = cache_ptr.dtype.element_ty
    tl.store(dst, to_cache(k, k_scale, FP8, ty), mask=mask)
    tl.store(dst + stride_c_kv, to_cache(v, v_scale, FP8, ty), mask=mask)


def store_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scale: torch.Tensor | None = None,
) -> None:
    """Write row t of k/v [T, num_kv_heads, head_dim] into `kv_cache` at flat slot
    `slot_mapping[t]` (int64; -1 = skip), as the cache's dtype stores it (FP8: divided by
    `kv_scale` [2], see ops/kv_cache.py). One program per slot, which reads its slot on the
    device: nothing waits for the GPU, and it can be captured in a CUDA graph. On CPU tensors
    (without the interpreter), the torch reference's store."""
    if not use_triton(k):
        from minivllm.worker.attention.torch_attention import store_kv

        store_kv(k, v, kv_cache, slot_mapping, kv_scale)
        return
    num_slots = slot_mapping.numel()
    if not num_slots:
        return
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    assert k.stride(2) == v.stride(2) == kv_cache.stride(4) == 1
    fp8 = kv_cache.dtype == FP8
    _store_kv_kernel[(num_slots,)](
        k, v, kv_cache, slot_mapping, kv_scale_arg(kv_scale, fp8, k),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), *kv_cache.stride()[:4],
        NUM_KV_HEADS=num_kv_heads, BLOCK_H=next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim, PAGE=kv_cache.shape[2], FP8=fp8, **pdl(k),
    )  # fmt: skip


def kv_scale_arg(kv_scale: torch.Tensor | None, fp8: bool, dummy: torch.Tensor) -> torch.Tensor:
    """The kernels' kv_scale pointer: read only for an FP8 cache, which must have one."""
    if fp8 and kv_scale is None:
        raise ValueError("an fp8 KV cache needs its kv_scale")
    return kv_scale if kv_scale is not None else dummy
