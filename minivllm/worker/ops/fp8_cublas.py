"""FP8 block-wise GEMMs on cuBLASLt: torch._scaled_mm with DeepSeek's recipe (x in 1x128
groups, W in 128x128 blocks), which cuBLASLt has on Hopper from CUDA 12.9. Where it runs it
is as fast as a bf16 GEMM or up to 1.6x faster on Qwen3-8B's layers, from 8 to 8,192 rows;
elsewhere the Triton GEMM of fp8_gemm.py runs (benchmarks/RESULTS.md, 2026-11-28)."""

from __future__ import annotations

import functools

import torch

from minivllm.worker.ops.fp8_gemm import (
    BLOCK,
    block_w8a8_torch,
    quantize_per_group,
    quantize_weight_block,
)


def block_scaled_mm(
    xq: torch.Tensor,
    xs: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    m: int,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """`quantize_per_group(x, for_cublas=True)`'s rows times e4m3 W [N, K] with its 128x128
    block scales [N/128, K/128], on cuBLASLt through torch._scaled_mm (DeepSeek's recipe:
    1x128 groups of x, 128x128 blocks of W); the first m rows."""
    y = torch._scaled_mm(xq, w.t(), scale_a=xs, scale_b=w_scale.t(), out_dtype=out_dtype)[:m]
    return y if bias is None else y + bias


def block_scales_on_cublas(w: torch.Tensor, scale_rows: int) -> bool:
    """Whether W [N, K] with its block scales goes through `block_scaled_mm`: one scale per
    128x128 block, N a multiple of 128 and K of 512 (cuBLASLt reads the scales four K blocks
    at a time), on a device where cuBLASLt has block scales (Hopper, CUDA 12.9+)."""
    n, k = w.shape
    if not w.is_cuda or scale_rows != BLOCK or n % BLOCK or k % (4 * BLOCK):
        return False
    return _cublas_block_scales(w.device.index or 0)


@functools.cache
def _cublas_block_scales(index: int) -> bool:
    """Tried once per device on a small problem against the float32 reference: False where
    torch or cuBLASLt lacks the recipe (it raises) or it disagrees."""
    if torch.cuda.get_device_capability(index) != (9, 0):
        return False
    device = torch.device("cuda", index)
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(6, 512, device=device, generator=gen).to(torch.bfloat16)
    wq, ws = quantize_weight_block(torch.randn(256, 512, device=device, generator=gen) * 0.05)
    try:
        got = block_scaled_mm(*quantize_per_group(x, for_cublas=True), wq, ws, 6, x.dtype)
    except RuntimeError:
        return False
    want = block_w8a8_torch(x, wq, ws)
    return bool(torch.allclose(got.float(), want.float(), atol=2e-2, rtol=2e-2))
