"""FP8 W8A8 linear layers: y = dequant(quant(x)) dequant(W)^T with e4m3 weights and
activations quantized at run time, each with float32 scales.

Two scale layouts, as the checkpoints carry them:
- block-wise (Qwen3-*-FP8, DeepSeek): W's scale per 128x128 block (`weight_scale_inv`
  [ceil(N/128), ceil(K/128)]), x's per token and group of 128 along K ([M, K/128]);
- per channel (llm-compressor's FP8_DYNAMIC, online fp8): W's scale per output row [N], x's
  per token [M].

An activation scale is max(|x| over its group, 1e-10) / 448 and x / scale is rounded to
e4m3 (saturating at +-448), the same in every kernel here and in the torch references.

Kernels: `quantize_per_group` / `quantize_per_token` (one small kernel before a GEMM), a
GEMM that applies both scales in its K loop (`scaled_fp8_gemm`, tl.dot on FP8 tensor cores),
and for one to four rows (batch-1 decode) a GEMV that quantizes its row's groups itself, so
a decode step pays no extra launch per layer (fp8_gemv.py). Where cuBLASLt takes the scales,
torch._scaled_mm replaces the GEMM: per-channel scales row-wise on any GPU with FP8 cuBLAS,
block scales on Hopper (fp8_cublas.py, where cuBLASLt has DeepSeek's recipe).
"""

from __future__ import annotations

import functools

import torch

from minivllm.worker.ops._triton import (
    grouped_tile,
    interpreting,
    pdl,
    tl,
    triton,
    use_triton,
    wait_for_producers,
)
from minivllm.worker.ops.kv_cache import FP8, FP8_MAX, to_e4m3

SCALE_EPS = 1e-10  # the smallest activation amax: an all-zero group still divides
BLOCK = 128  # the block-wise format's block edge, and its activation group


@functools.cache
def _fp8_device(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (8, 9)


def fp8_kernels(x: torch.Tensor) -> bool:
    """Whether the FP8 kernels run for x: on a GPU with FP8 tensor cores (compute capability
    8.9+) or under the Triton interpreter; else the dequantizing reference path."""
    if not use_triton(x):
        return False
    return interpreting() if not x.is_cuda else _fp8_device(x.device.index or 0)


# ---- torch references (the CPU path and what the kernels are checked against)


def quantize_groups_torch(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], float32 scales [M, ceil(K / group)]), K zero-padded."""
    m, k = x.shape
    groups = -(-k // group)
    padded = torch.zeros(m, groups * group, dtype=torch.float32, device=x.device)
    padded[:, :k] = x.float()
    g = padded.view(m, groups, group)
    scale = g.abs().amax(-1).clamp(min=SCALE_EPS) / FP8_MAX
    q = to_e4m3(g / scale[..., None])
    return q.view(m, -1)[:, :k], scale


def expand_block_scales(scale: torch.Tensor, n: int, k: int, rows: int = BLOCK) -> torch.Tensor:
    """[ceil(N/rows), ceil(K/128)] block scales -> [N, K], one per weight."""
    return scale.repeat_interleave(rows, 0)[:n].repeat_interleave(BLOCK, 1)[:, :k]


def dequantize_block(
    w: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, rows: int = BLOCK
) -> torch.Tensor:
    """e4m3 W [N, K] with 128x128 block scales (`rows` 1: each row's copy) -> W in `dtype`."""
    return (w.float() * expand_block_scales(scale.float(), *w.shape, rows)).to(dtype)


def dequantize_channel(w: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """e4m3 W [N, K] with per-row scales [N] -> W in `dtype`."""
    return (w.float() * scale.float().view(-1, 1)).to(dtype)


def block_w8a8_torch(
    x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """What the block-wise kernels compute, in float32: x quantized per token group of 128,
    times the dequantized W."""
    xq, xs = quantize_groups_torch(x, BLOCK)
    xd = xq.float().view(x.shape[0], -1) * xs.repeat_interleave(BLOCK, 1)[:, : x.shape[1]]
    y = xd @ dequantize_block(w, w_scale, torch.float32).T
    return (y if bias is None else y + bias.float()).to(x.dtype)


def channel_w8a8_torch(
    x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """What the per-channel kernels compute, in float32: x quantized per token."""
    xq, xs = quantize_groups_torch(x, x.shape[1])
    y = (xq.float() * xs) @ dequantize_channel(w, w_scale, torch.float32).T
    return (y if bias is None else y + bias.float()).to(x.dtype)


def quantize_weight_block(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] -> (e4m3 W, float32 `weight_scale_inv` [ceil(N/128), ceil(K/128)]): each
    block's max |w| maps to 448, as the block-wise checkpoints are written."""
    n, k = w.shape
    bn, bk = -(-n // BLOCK), -(-k // BLOCK)
    padded = torch.zeros(bn * BLOCK, bk * BLOCK, dtype=torch.float32, device=w.device)
    padded[:n, :k] = w.float()
    blocks = padded.view(bn, BLOCK, bk, BLOCK)
    scale = blocks.abs().amax((1, 3)).clamp(min=1e-12) / FP8_MAX
    q = to_e4m3(blocks / scale[:, None, :, None])
    return q.view(bn * BLOCK, bk * BLOCK)[:n, :k].contiguous(), scale


def quantize_weight_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] -> (e4m3 W, float32 per-row scales [N]): each row's max |w| maps to 448."""
    scale = w.float().abs().amax(1).clamp(min=1e-12) / FP8_MAX
    q = to_e4m3(w.float() / scale[:, None])
    return q, scale


# ---- Triton kernels


@triton.jit
def quantize_e4m3(x, scale):
    # x / scale rounded as torch's division (IEEE): the fast division's last-bit error flips
    # a few e4m3 roundings, each off by a whole e4m3 step
    return tl.clamp(tl.div_rn(x, scale), -448.0, 448.0).to(tl.float8e4nv)


@triton.jit
def _quantize_groups_kernel(
    x_ptr, q_ptr, s_ptr, K, num_groups, stride_xm, stride_qm, stride_sm, stride_sg,
    GROUP: tl.constexpr, GROUPS_PER_PROG: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    row = tl.program_id(0)
    offs_g = tl.program_id(1) * GROUPS_PER_PROG + tl.arange(0, GROUPS_PER_PROG)
    offs_k = offs_g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    mask = (offs_g[:, None] < num_groups) & (offs_k < K)
    wait_for_producers(PDL)
    x = tl.load(x_ptr + row * stride_xm + offs_k, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), 1), 1e-10) / 448.0
    tl.store(q_ptr + row * stride_qm + offs_k, quantize_e4m3(x, scale[:, None]), mask=mask)
    tl.store(s_ptr + row * stride_sm + offs_g * stride_sg, scale, mask=offs_g < num_groups)


def quantize_per_group(
    x: torch.Tensor, group: int = BLOCK, for_cublas: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (16-bit or float32) -> (e4m3 [M, K], float32 scales [M, ceil(K / group)]).
    `for_cublas`: as `fp8_cublas.block_scaled_mm` reads them, M rounded up to four rows (the
    extra rows zero) and the scales column-major (stride [1, M])."""
    m, k = x.shape
    assert x.stride(1) == 1
    num_groups = -(-k // group)
    rows = -(-m // 4) * 4 if for_cublas else m
    q = torch.empty((rows, k), dtype=FP8, device=x.device)
    if for_cublas:
        s = torch.empty((num_groups, rows), dtype=torch.float32, device=x.device).t()
        if rows > m:
            q[m:].zero_()
            s[m:].fill_(1.0)
    else:
        s = torch.empty((m, num_groups), dtype=torch.float32, device=x.device)
    per_prog = min(8, triton.next_power_of_2(num_groups))
    grid = (m, triton.cdiv(num_groups, per_prog))
    _quantize_groups_kernel[grid](
        x, q, s, k, num_groups, x.stride(0), q.stride(0), s.stride(0), s.stride(1),
        GROUP=group, GROUPS_PER_PROG=per_prog, num_warps=4, **pdl(x),
    )  # fmt: skip
    return q, s


@triton.jit
def _quantize_row_kernel(
    x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm, BLOCK_K: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_K)
    wait_for_producers(PDL)
    amax = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        x = tl.load(x_ptr + row * stride_xm + k + offs, mask=k + offs < K, other=0.0)
        amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
    scale = tl.maximum(tl.max(amax, 0), 1e-10) / 448.0
    for k in range(0, K, BLOCK_K):
        x = tl.load(x_ptr + row * stride_xm + k + offs, mask=k + offs < K, other=0.0)
        tl.store(q_ptr + row * stride_qm + k + offs, quantize_e4m3(x.to(tl.float32), scale),
                 mask=k + offs < K)  # fmt: skip
    tl.store(s_ptr + row, scale)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], float32 scales [M, 1])."""
    m, k = x.shape
    assert x.stride(1) == 1
    q = torch.empty((m, k), dtype=FP8, device=x.device)
    s = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    block_k = min(2048, triton.next_power_of_2(k))
    _quantize_row_kernel[(m,)](
        x, q, s, k, x.stride(0), q.stride(0), BLOCK_K=block_k, num_warps=4, **pdl(x)
    )
    return q, s


@triton.jit
def _scaled_gemm_kernel(
    a_ptr, b_ptr, c_ptr, as_ptr, bs_ptr, bias_ptr, M, N, K,
    stride_am, stride_bn, stride_cm, stride_asm, stride_ask, stride_bsn, stride_bsk,
    B_SCALE_ROWS: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """C = A B^T for e4m3 A [M, K] and B [N, K]; A's scale per (row, K block) and B's per
    (B_SCALE_ROWS rows, K block), applied to each K block's tl.dot (per-token and
    per-channel scales: stride over K 0)."""
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_am, offs_bn = offs_m % M, offs_n % N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_am[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + offs_bn[None, :] * stride_bn + offs_k[:, None]
    as_ptrs = as_ptr + offs_am * stride_asm
    bs_ptrs = bs_ptr + (offs_bn // B_SCALE_ROWS) * stride_bsn
    wait_for_producers(PDL)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - kb * BLOCK_K
        a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
        b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        a_s = tl.load(as_ptrs + kb * stride_ask)
        b_s = tl.load(bs_ptrs + kb * stride_bsk)
        acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_bn).to(tl.float32)[None, :]
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :]
    tl.store(
        c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N)
    )


def _gemm_tiles(m: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages): small tiles for a few rows."""
    if m <= 16:
        return 16, 64, 4, 4
    if m <= 64:
        return 64, 128, 4, 3
    return 128, 128, 8, 3


def scaled_fp8_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    b_scale_rows: int,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """e4m3 a [M, K] @ b [N, K]^T with a_scale [M, ceil(K/128) or 1] and b_scale
    [ceil(N / b_scale_rows), ceil(K/128) or 1] (a last dim of 1: one scale for all of K)."""
    m, k = a.shape
    n = b.shape[0]
    b_scale = b_scale.view(b_scale.shape[0], -1)
    c = torch.empty((m, n), dtype=out_dtype, device=a.device)
    bm, bn, warps, stages = _gemm_tiles(m)
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    a_scale_k = a_scale.stride(1) if a_scale.shape[1] > 1 else 0
    b_scale_k = b_scale.stride(1) if b_scale.shape[1] > 1 else 0
    _scaled_gemm_kernel[grid](
        a, b, c, a_scale, b_scale, b_scale if bias is None else bias, m, n, k,
        a.stride(0), b.stride(0), c.stride(0), a_scale.stride(0), a_scale_k,
        b_scale.stride(0), b_scale_k,
        B_SCALE_ROWS=b_scale_rows, HAS_BIAS=bias is not None,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=BLOCK, GROUP_M=8,
        num_warps=warps, num_stages=stages, **pdl(a),
    )  # fmt: skip
    return c
