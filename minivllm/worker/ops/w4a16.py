"""INT4 weight-only linear layers (AWQ, GPTQ): y = x dequant(W)^T with 4-bit weights that the
kernels dequantize in registers, activations left in the model's dtype.

Both formats are repacked at load into one layout, read along K like the 16-bit GEMV reads W:
- `qweight` int32 [N, K/8]: weight (n, k) is bits 4*(k%8).. of qweight[n, k // 8];
- `scales` [N, groups] (the checkpoint's dtype) and `zeros` uint8 [N, groups], the zero point
  itself (GPTQ's stored zero + 1 already added);
- w(n, k) = (q(n, k) - zeros[n, g(k)]) * scales[n, g(k)] with g(k) = k // group_size, or, for
  GPTQ with act-order under a row-parallel split, g(k) = g_idx[k] (`g_idx`);
- act-order (`desc_act`) checkpoints are permuted at load so that each group's rows lie
  together (exllama's shuffle): the kernels then read x at `perm[k]` instead of k.

`w4_gemv` serves one to four rows (decode), `w4_gemm` up to a few hundred (tl.dot on the
tensor cores in the activation dtype); a prompt's many rows multiply a 16-bit W that
`w4_dequantize` writes, on cuBLAS (the same products as the GEMM's; it reads 16-bit weights
once per prompt and runs at the tensor cores' full rate). `dequantize_w4` is the torch
reference.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from minivllm.worker.ops._triton import grouped_tile, pdl, tl, triton, wait_for_producers


class W4Weights(NamedTuple):
    """One linear layer's 4-bit weight in the kernels' layout (see the module docstring)."""

    qweight: torch.Tensor  # int32 [N, K/8]
    scales: torch.Tensor  # [N, groups]
    zeros: torch.Tensor  # uint8 [N, groups]
    group_size: int  # rows of K per group (K itself for one group)
    perm: torch.Tensor | None = None  # int32 [K]: x's column of each k (act-order)
    g_idx: torch.Tensor | None = None  # int32 [K]: k's group, where groups are not k // size


# ---- packing and the torch reference


def pack_along_k(q: torch.Tensor) -> torch.Tensor:
    """4-bit values int [N, K] -> int32 [N, K/8], value k in bits 4*(k%8)."""
    n, k = q.shape
    shifts = torch.arange(0, 32, 4, device=q.device, dtype=torch.int64)
    words = (q.to(torch.int64).view(n, k // 8, 8) << shifts).sum(-1)
    return to_int32(words)


def to_int32(words: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit words (int64) as the int32 of the same bits."""
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def unpack_along_k(qweight: torch.Tensor) -> torch.Tensor:
    """int32 [N, K/8] -> int32 [N, K] of 4-bit values."""
    shifts = torch.arange(0, 32, 4, device=qweight.device, dtype=torch.int32)
    return ((qweight[:, :, None] >> shifts) & 0xF).flatten(1)


def group_index(w: W4Weights, k: int) -> torch.Tensor:
    """Each k's group."""
    if w.g_idx is not None:
        return w.g_idx.long()
    return torch.arange(k, device=w.qweight.device) // w.group_size


def dequantize_w4(w: W4Weights, dtype: torch.dtype) -> torch.Tensor:
    """The weight [N, K] in `dtype`, columns in the kernels' (permuted) order."""
    q = unpack_along_k(w.qweight)
    g = group_index(w, q.shape[1])
    return ((q - w.zeros[:, g].int()).float() * w.scales[:, g].float()).to(dtype)


def w4_linear_torch(
    x: torch.Tensor, w: W4Weights, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [M, K] @ dequant(W)^T (+ bias): dequantize to x's dtype, then a plain matmul."""
    if w.perm is not None:
        x = x[:, w.perm.long()]
    return torch.nn.functional.linear(x, dequantize_w4(w, x.dtype), bias)


# ---- Triton kernels


@triton.jit
def _unpack(q, ROWS: tl.constexpr, COLS: tl.constexpr):
    """int32 [ROWS, COLS / 8] -> int32 [ROWS, COLS] of 4-bit values."""
    shifts = tl.arange(0, 8) * 4
    return tl.reshape((q[:, :, None] >> shifts[None, None, :]) & 0xF, [ROWS, COLS])


@triton.jit
def _w4_gemv_kernel(
    x_ptr, q_ptr, s_ptr, z_ptr, perm_ptr, g_ptr, bias_ptr, out_ptr, K,
    stride_xm, stride_qn, stride_sn, stride_om,
    M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, GROUP: tl.constexpr,
    HAS_PERM: tl.constexpr, HAS_G_IDX: tl.constexpr, HAS_BIAS: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    """y = x dequant(W)^T for M <= 4 rows; each program owns BLOCK_N rows of W and reads
    BLOCK_W words (8 weights each) of them per iteration, taking the words' 8 nibbles in
    turn: nibble j of word i is weight k = 8i + j, times x[k] (x[perm[k]] under act-order).
    No unpacked tile is built (no reshape: 2-3x faster than unpacking [BLOCK_N, BLOCK_K]
    on an H100). A word lies in one group (GROUP is a multiple of 8), so its scale s and zero
    z are loaded once for its 8 weights, and applied once: sum_j (q_j - z) s x_j =
    s (sum_j q_j x_j - z sum_j x_j)."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_w = tl.arange(0, BLOCK_W)
    q_ptrs = q_ptr + offs_n[:, None] * stride_qn + offs_w[None, :]
    rows_s = s_ptr + offs_n[:, None] * stride_sn
    rows_z = z_ptr + offs_n[:, None] * stride_sn
    wait_for_producers(PDL)
    for m in tl.static_range(M):
        x_row = x_ptr + m * stride_xm
        # products summed over K once, after the loop (as ops/gemv.py)
        acc = tl.zeros([BLOCK_N, BLOCK_W], dtype=tl.float32)
        for kw in range(0, K // 8, BLOCK_W):
            q = tl.load(q_ptrs + kw)
            first = (kw + offs_w) * 8  # each word's first k
            if HAS_G_IDX:  # a group per k: its scale and zero gathered per nibble
                for j in tl.static_range(8):
                    cols = first + j
                    if HAS_PERM:
                        cols = tl.load(perm_ptr + first + j)
                    x = tl.load(x_row + cols).to(tl.float32)[None, :]
                    g = tl.load(g_ptr + first + j)[None, :]
                    s = tl.load(rows_s + g).to(tl.float32)
                    z = tl.load(rows_z + g).to(tl.float32)
                    acc += (((q >> (4 * j)) & 0xF).to(tl.float32) - z) * s * x
            else:
                dot = tl.zeros([BLOCK_N, BLOCK_W], dtype=tl.float32)
                x_sum = tl.zeros([BLOCK_W], dtype=tl.float32)
                for j in tl.static_range(8):
                    cols = first + j
                    if HAS_PERM:
                        cols = tl.load(perm_ptr + first + j)
                    x = tl.load(x_row + cols).to(tl.float32)
                    dot += ((q >> (4 * j)) & 0xF).to(tl.float32) * x[None, :]
                    x_sum += x
                g = (first // GROUP)[None, :]
                s = tl.load(rows_s + g).to(tl.float32)
                z = tl.load(rows_z + g).to(tl.float32)
                acc += s * (dot - z * x_sum[None, :])
        acc = tl.sum(acc, 1)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n).to(tl.float32)
        tl.store(out_ptr + m * stride_om + offs_n, acc.to(out_ptr.dtype.element_ty))


class W4GemvConfig(NamedTuple):
    block_n: int  # rows of W per program
    block_w: int  # int32 words (8 weights each) of each row per iteration
    num_warps: int


def w4_gemv_config(n: int, k: int, group: int) -> W4GemvConfig | None:
    """16 rows of W per program and 256 words (2048 of K, 1 KB of each row) per iteration
    where the shape allows: the fastest of 22 tile shapes measured on an H100 at three of
    Qwen3-8B's four layers (and within 10% at the fourth). None when the kernel cannot tile
    it."""
    block_n = next((b for b in (16, 8, 4) if n % b == 0), None)
    block_w = next((b for b in (256, 128, 64, 32, 16, 8, 4) if k % (8 * b) == 0), None)
    if block_n is None or block_w is None or group % 8:
        return None
    return W4GemvConfig(block_n, block_w, 4)


def w4_gemv(
    x: torch.Tensor, w: W4Weights, cfg: W4GemvConfig, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [M <= 4, K] @ dequant(W)^T -> [M, N] in x's dtype (float32 accumulation)."""
    m, k = x.shape
    n = w.qweight.shape[0]
    if not (1 <= m <= 4 and n % cfg.block_n == 0 and k % (8 * cfg.block_w) == 0):
        raise ValueError(f"config {cfg} does not tile M={m}, N={n}, K={k}")
    assert x.stride(1) == 1 and w.scales.stride(0) == w.zeros.stride(0)
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    dummy = w.qweight
    _w4_gemv_kernel[(n // cfg.block_n,)](
        x, w.qweight, w.scales, w.zeros, dummy if w.perm is None else w.perm,
        dummy if w.g_idx is None else w.g_idx, dummy if bias is None else bias, out, k,
        x.stride(0), w.qweight.stride(0), w.scales.stride(0), out.stride(0),
        M=m, BLOCK_N=cfg.block_n, BLOCK_W=cfg.block_w, GROUP=w.group_size,
        HAS_PERM=w.perm is not None, HAS_G_IDX=w.g_idx is not None,
        HAS_BIAS=bias is not None, num_warps=cfg.num_warps, **pdl(x),
    )  # fmt: skip
    return out


@triton.jit
def _w4_gemm_kernel(
    a_ptr, q_ptr, s_ptr, z_ptr, perm_ptr, g_ptr, bias_ptr, c_ptr, M, N, K,
    stride_am, stride_qn, stride_sn, stride_cm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
    GROUP_M: tl.constexpr, HAS_PERM: tl.constexpr, HAS_G_IDX: tl.constexpr,
    HAS_BIAS: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    """C = A dequant(W)^T: each K block of W is dequantized in registers to A's dtype and
    fed to tl.dot; BLOCK_K divides the group size, so one scale per row and block."""
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_am, offs_bn = offs_m % M, offs_n % N
    offs_k = tl.arange(0, BLOCK_K)
    offs_k8 = tl.arange(0, BLOCK_K // 8)
    wait_for_producers(PDL)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        cols = k + offs_k
        if HAS_PERM:
            cols = tl.load(perm_ptr + k + offs_k)
        a = tl.load(a_ptr + offs_am[:, None] * stride_am + cols[None, :])
        q = tl.load(q_ptr + offs_bn[:, None] * stride_qn + k // 8 + offs_k8[None, :])
        w = _unpack(q, BLOCK_N, BLOCK_K).to(tl.float32)
        if HAS_G_IDX:
            g = tl.load(g_ptr + k + offs_k)
            s = tl.load(s_ptr + offs_bn[:, None] * stride_sn + g[None, :]).to(tl.float32)
            z = tl.load(z_ptr + offs_bn[:, None] * stride_sn + g[None, :]).to(tl.float32)
            b = (w - z) * s
        else:
            s = tl.load(s_ptr + offs_bn * stride_sn + k // GROUP).to(tl.float32)
            z = tl.load(z_ptr + offs_bn * stride_sn + k // GROUP).to(tl.float32)
            b = (w - z[:, None]) * s[:, None]
        acc += tl.dot(a, tl.trans(b.to(a.dtype)))
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_bn).to(tl.float32)[None, :]
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :]
    tl.store(
        c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N)
    )


def w4_gemm_block_k(k: int, group: int) -> int | None:
    """The K block of the GEMM: a power of two >= 16 dividing K and the group size."""
    return next((b for b in (128, 64, 32, 16) if k % b == 0 and group % b == 0), None)


def w4_gemm(x: torch.Tensor, w: W4Weights, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ dequant(W)^T -> [M, N] in x's dtype."""
    m, k = x.shape
    n = w.qweight.shape[0]
    block_k = w4_gemm_block_k(k, w.group_size)
    if block_k is None:
        raise ValueError(f"no K block divides K={k} and group size {w.group_size}")
    assert x.stride(1) == 1 and w.scales.stride(0) == w.zeros.stride(0)
    if m <= 16:
        bm, bn, warps, stages = 16, 64, 4, 4
    elif m <= 64:
        bm, bn, warps, stages = 64, 64, 4, 3
    else:
        bm, bn, warps, stages = 128, 128, 8, 3
    c = torch.empty((m, n), dtype=x.dtype, device=x.device)
    dummy = w.qweight
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    _w4_gemm_kernel[grid](
        x, w.qweight, w.scales, w.zeros, dummy if w.perm is None else w.perm,
        dummy if w.g_idx is None else w.g_idx, dummy if bias is None else bias, c, m, n, k,
        x.stride(0), w.qweight.stride(0), w.scales.stride(0), c.stride(0),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=block_k, GROUP=w.group_size, GROUP_M=8,
        HAS_PERM=w.perm is not None, HAS_G_IDX=w.g_idx is not None, HAS_BIAS=bias is not None,
        num_warps=warps, num_stages=stages, **pdl(x),
    )  # fmt: skip
    return c


@triton.jit
def _w4_dequantize_kernel(
    q_ptr, s_ptr, z_ptr, g_ptr, out_ptr, N, K, stride_qn, stride_sn, stride_on,
    BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, GROUP: tl.constexpr,
    HAS_G_IDX: tl.constexpr,
):  # fmt: skip
    """W [N, K] in out's dtype, rounded from float32 as `dequantize_w4` rounds it: each
    program expands BLOCK_N rows x BLOCK_W words, nibble j of word i to column 8i + j."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_w = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    mask = (offs_n[:, None] < N) & (offs_w[None, :] < K // 8)
    q = tl.load(q_ptr + offs_n[:, None] * stride_qn + offs_w[None, :], mask=mask, other=0)
    first = offs_w * 8
    rows_s = s_ptr + offs_n[:, None] * stride_sn
    rows_z = z_ptr + offs_n[:, None] * stride_sn
    out_rows = out_ptr + offs_n[:, None] * stride_on
    for j in tl.static_range(8):
        if HAS_G_IDX:
            g = tl.load(g_ptr + first + j, mask=offs_w < K // 8, other=0)[None, :]
        else:
            g = ((first + j) // GROUP)[None, :]
        s = tl.load(rows_s + g, mask=mask, other=0.0).to(tl.float32)
        z = tl.load(rows_z + g, mask=mask, other=0).to(tl.float32)
        w = (((q >> (4 * j)) & 0xF).to(tl.float32) - z) * s
        tl.store(out_rows + first[None, :] + j, w.to(out_ptr.dtype.element_ty), mask=mask)


def w4_dequantize(w: W4Weights, dtype: torch.dtype) -> torch.Tensor:
    """The weight [N, K] in `dtype` (columns in the kernels' order), on the GPU: what
    `dequantize_w4` computes, without its int32 and float32 copies of W."""
    n, k = w.qweight.shape[0], w.qweight.shape[1] * 8
    out = torch.empty((n, k), dtype=dtype, device=w.qweight.device)
    block_n, block_w = 16, 64
    grid = (triton.cdiv(n, block_n), triton.cdiv(k // 8, block_w))
    _w4_dequantize_kernel[grid](
        w.qweight, w.scales, w.zeros, w.qweight if w.g_idx is None else w.g_idx, out, n, k,
        w.qweight.stride(0), w.scales.stride(0), out.stride(0),
        BLOCK_N=block_n, BLOCK_W=block_w, GROUP=w.group_size, HAS_G_IDX=w.g_idx is not None,
        num_warps=4,
    )  # fmt: skip
    return out


def w4_dequantized_linear(
    x: torch.Tensor, w: W4Weights, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [M, K] @ dequant(W)^T for a prompt's many rows: W dequantized to x's dtype, then
    cuBLAS (x's columns permuted first under act-order)."""
    if w.perm is not None:
        x = x.index_select(1, w.perm.long())
    return torch.nn.functional.linear(x, w4_dequantize(w, x.dtype), bias)
