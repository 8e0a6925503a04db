"""The FP8 GEMV of batch-1 decode: y = quant(x) dequant(W)^T for one to four rows of x.

Each program owns a few rows of W and quantizes x's groups itself as it reads them (the
scales and rounding of fp8_gemm.py), so a decode step pays no quantization launch per layer;
W's scales are folded into x's dequantized values where the program's rows share them. It
takes both of fp8_gemm.py's weight formats: 128x128 block scales (and shards with a scale
row per weight row) and per-channel scales with per-token activations.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from minivllm.worker.ops._triton import pdl, tl, triton, wait_for_producers
from minivllm.worker.ops.fp8_gemm import BLOCK, quantize_e4m3


class Fp8GemvConfig(NamedTuple):
    block_n: int  # output rows per program
    groups: int  # 128-wide groups of K per loop iteration
    num_warps: int


# how W's scales apply in the GEMV: after the sum, per row (per channel); per group, one row
# of scales shared by the program's rows (128x128 blocks); per row and group (a scale row per
# weight row: shards that do not start on a block)
_ROW_SCALE, _GROUP_SCALE, _ROW_GROUP_SCALE = 0, 1, 2


@triton.jit
def _fp8_gemv_kernel(
    x_ptr, w_ptr, ws_ptr, bias_ptr, out_ptr, K, stride_xm, stride_wn, stride_om,
    stride_wsn, stride_wsk,
    M: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, BLOCK_K: tl.constexpr,
    SCALE_MODE: tl.constexpr, PER_TOKEN: tl.constexpr, HAS_BIAS: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """y = quant(x) W^T for M <= 4 rows: each program owns BLOCK_N rows of W and reads
    BLOCK_K = GROUPS x 128 of K per iteration as a [BLOCK_N, GROUPS, 128] tile, quantizing
    x's groups itself (PER_TOKEN: the row's one scale, from a first pass over it). W's scales
    are folded into x's dequantized values where the program's rows share them, so each
    weight costs one conversion and one multiply-add."""
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_g = tl.arange(0, GROUPS)
    offs_gk = offs_g[:, None] * 128 + tl.arange(0, 128)[None, :]
    w_ptrs = w_ptr + offs_n[:, None, None] * stride_wn + offs_gk[None, :, :]
    wait_for_producers(PDL)
    for m in tl.static_range(M):
        x_row = x_ptr + m * stride_xm
        x_scale = 1.0
        if PER_TOKEN:
            amax = tl.zeros([GROUPS, 128], dtype=tl.float32)
            for k in range(0, K, BLOCK_K):
                amax = tl.maximum(amax, tl.abs(tl.load(x_row + k + offs_gk).to(tl.float32)))
            x_scale = tl.maximum(tl.max(tl.max(amax, 1), 0), 1e-10) / 448.0
        # products summed over K once, after the loop (as ops/gemv.py)
        acc = tl.zeros([BLOCK_N, GROUPS, 128], dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            w = tl.load(w_ptrs + k).to(tl.float32)
            x = tl.load(x_row + k + offs_gk).to(tl.float32)
            if PER_TOKEN:
                xq = quantize_e4m3(x, x_scale).to(tl.float32) * x_scale
            else:
                scale = tl.maximum(tl.max(tl.abs(x), 1), 1e-10)[:, None] / 448.0
                xq = quantize_e4m3(x, scale).to(tl.float32) * scale
            groups = k // 128 + offs_g
            if SCALE_MODE == 1:
                w_scale = tl.load(
                    ws_ptr + (pid * BLOCK_N // 128) * stride_wsn + groups * stride_wsk
                )
                acc += w * (xq * w_scale[:, None])[None, :, :]
            elif SCALE_MODE == 2:
                w_scale = tl.load(
                    ws_ptr + offs_n[:, None] * stride_wsn + groups[None, :] * stride_wsk
                )
                acc += w * xq[None, :, :] * w_scale[:, :, None]
            else:
                acc += w * xq[None, :, :]
        y = tl.sum(tl.sum(acc, 2), 1)
        if SCALE_MODE == 0:
            y *= tl.load(ws_ptr + offs_n * stride_wsn)
        if HAS_BIAS:
            y += tl.load(bias_ptr + offs_n).to(tl.float32)
        tl.store(out_ptr + m * stride_om + offs_n, y.to(out_ptr.dtype.element_ty))


def fp8_gemv_config(n: int, k: int) -> Fp8GemvConfig | None:
    """8 rows per program (4 for small N, so more programs) and 8 groups (1 KB of each row)
    per iteration where K allows: of 30 variants measured on an H100 at Qwen3-8B's four
    layers, the fastest at two and within 2% at the others (1.6-2.8x an [8, 128] tile per
    iteration). None when the kernel cannot tile the shape."""
    if k % BLOCK or n % 4:
        return None
    groups = next(g for g in (8, 4, 2, 1) if (k // BLOCK) % g == 0)
    block_n = 8 if n % 8 == 0 and n >= 4096 else 4
    return Fp8GemvConfig(block_n, groups, 4)


def fp8_gemv(
    x: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    w_scale_rows: int,
    per_token: bool,
    cfg: Fp8GemvConfig,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M <= 4, K] (16-bit) @ e4m3 w [N, K]^T -> [M, N] in x's dtype. w_scale: block scales
    [ceil(N / w_scale_rows), K/128] (w_scale_rows 128 or 1; activations per group) or per-row
    [N, 1] (w_scale_rows 1, per_token)."""
    m, k = x.shape
    n = w.shape[0]
    if not (1 <= m <= 4 and n % cfg.block_n == 0 and k % (BLOCK * cfg.groups) == 0):
        raise ValueError(f"config {cfg} does not tile M={m}, N={n}, K={k}")
    assert x.stride(1) == 1 and w.stride(1) == 1
    w_scale = w_scale.view(w_scale.shape[0], -1)
    if per_token:
        mode = _ROW_SCALE
    elif w_scale_rows == BLOCK and BLOCK % cfg.block_n == 0:
        mode = _GROUP_SCALE
    elif w_scale_rows == 1:
        mode = _ROW_GROUP_SCALE
    else:
        raise ValueError(f"w_scale_rows must be 1 or {BLOCK}, got {w_scale_rows}")
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    _fp8_gemv_kernel[(n // cfg.block_n,)](
        x, w, w_scale, w_scale if bias is None else bias, out, k,
        x.stride(0), w.stride(0), out.stride(0),
        w_scale.stride(0), w_scale.stride(1),
        M=m, BLOCK_N=cfg.block_n, GROUPS=cfg.groups, BLOCK_K=BLOCK * cfg.groups,
        SCALE_MODE=mode, PER_TOKEN=per_token, HAS_BIAS=bias is not None,
        num_warps=cfg.num_warps, **pdl(x),
    )  # fmt: skip
    return out
