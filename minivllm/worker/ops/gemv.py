"""y = x W^T for one to four rows (decode at batch 1 to 4, a verification's few rows): a
Triton GEMV, optionally with the op that produces x fused in front of it.

At batch 1 every linear layer is a matrix-vector product that reads W once; cuBLAS runs
them as GEMMs with 8-row tiles and, for N = 1024, a split-K pass plus a reduction kernel.
Here each program owns BLOCK_N output features and streams their rows of W in BLOCK_K
slices, multiplying on the CUDA cores (no tensor-core tile to pad a single row to) and
reducing in float32. One row runs `_gemv_kernel`; two to four run `_gemv_rows_kernel`,
which reads each slice of W once for all of them (the one-row kernel reloading W per row
lost to cuBLAS from two rows on).

At batch 1 a step is ~300 kernels of a few µs each, so the small kernels between the GEMVs
cost as much as their work. Two prologues remove them: every program recomputes the
(residual-add +) RMSNorm of its input rows (a few KB read from L2; program 0 also writes the
new residual stream), or SiLU(gate) * up (GELU-tanh(gate) * up) of the gate_up output. The
values fed to the dot are rounded to the activation dtype exactly as the separate kernels
round what they store.

Measured per Qwen3-0.6B layer on an H200 (qkv, o, gate_up and down with their prologues,
against cuBLAS with the separate norm and SiLU kernels, CUDA graphs over 28 layers' weights):
16 against 33 µs at one row, 22-27 against 32-36 at two to four, and 49 against 29-32 at
five to eight rows (the register tile of eight rows spills). For Qwen3-8B's layers
(K >= 4096) cuBLAS is 3% faster at one row and 1.5-2.6x faster at two to four, so the GEMV
takes several rows only where K is at most MAX_ROWS_K.

`linear` is what the linear layers call: the GEMV for the rows it takes, cuBLAS (or the CPU)
for anything else. The fused ops that run a prologue (`layers/fused.py`: `rms_norm_linear`,
`silu_mul_linear`) ask `row_gemv_config` whether the GEMV takes their rows.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from minivllm.worker.ops._triton import (
    next_power_of_2,
    pdl,
    tl,
    triton,
    use_triton,
    wait_for_producers,
)
from minivllm.worker.ops.activation import gelu_tanh_mul, silu_mul
from minivllm.worker.ops.norm import add_residual, rms_scale, row_rstd

# what the kernel computes x from
_PLAIN, _RMS_NORM, _SILU_MUL, _GELU_MUL = 0, 1, 2, 3
MAX_ROWS = 4  # rows one launch takes
MAX_ROWS_K = 3072  # the largest K for which the GEMV takes more than one row


class GemvConfig(NamedTuple):
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


@triton.jit
def _residual_slice(x_row, res_row, new_res_row, k, offs_k, write_res, HAS_RESIDUAL: tl.constexpr):
    """x (+ residual, rounded to the dtype) over one K slice; stored as the new residual
    stream when write_res (one program does)."""
    h = tl.load(x_row + k + offs_k)
    if HAS_RESIDUAL:
        h = add_residual(h, tl.load(res_row + k + offs_k))
        if write_res:
            tl.store(new_res_row + k + offs_k, h)
    return h


@triton.jit
def _scaled_slice(h, rstd, nw_ptr, k, offs_k):
    """RMSNorm's output over one K slice as ops/norm.py rounds it, in float32 for the dot
    (of several rows: h [M_PAD, BLOCK_K] and each row's rstd, [M_PAD, 1])."""
    return rms_scale(h, rstd, tl.load(nw_ptr + k + offs_k)).to(h.dtype).to(tl.float32)


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, out_ptr, K, stride_xm, stride_wn, stride_om,
    res_ptr, new_res_ptr, nw_ptr, eps,
    M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, ONE_SLICE: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :]
    if not (PROLOGUE == 1 and ONE_SLICE):
        wait_for_producers(PDL)
    for m in tl.static_range(M):
        x_row = x_ptr + m * stride_xm
        if PROLOGUE == 1 and ONE_SLICE:
            # K fits one slice (hidden 1024): the weights are loaded first, so the time they
            # take to arrive covers the norm's loads and its sum over the row -- and, the
            # weights being no kernel's output, under PDL the previous kernel's tail too
            w = tl.load(w_ptrs)
            if m == 0:
                wait_for_producers(PDL)
            h = _residual_slice(
                x_row, res_ptr + m * K, new_res_ptr + m * K, 0, offs_k, pid == 0, HAS_RESIDUAL
            )
            rstd = row_rstd(h, K, eps)
            acc = w.to(tl.float32) * _scaled_slice(h, rstd, nw_ptr, 0, offs_k)[None, :]
        else:
            rstd = 0.0
            if PROLOGUE == 1:  # the row's sum of squares first, in a pass of its own
                ss = tl.zeros([BLOCK_K], dtype=tl.float32)
                for k in range(0, K, BLOCK_K):
                    h = _residual_slice(x_row, res_ptr + m * K, x_row, k, offs_k, False,
                                        HAS_RESIDUAL)  # fmt: skip
                    hf = h.to(tl.float32)
                    ss += hf * hf
                rstd = tl.rsqrt(tl.sum(ss, 0) / K + eps)
            acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
            for k in range(0, K, BLOCK_K):
                w = tl.load(w_ptrs + k)
                if PROLOGUE == 1:
                    h = _residual_slice(x_row, res_ptr + m * K, new_res_ptr + m * K, k, offs_k,
                                        pid == 0, HAS_RESIDUAL)  # fmt: skip
                    x = _scaled_slice(h, rstd, nw_ptr, k, offs_k)
                elif PROLOGUE == 2:
                    gate = tl.load(x_row + k + offs_k)
                    up = tl.load(x_row + K + k + offs_k)
                    x = silu_mul(gate, up).to(up.dtype).to(tl.float32)
                elif PROLOGUE == 3:
                    gate = tl.load(x_row + k + offs_k)
                    up = tl.load(x_row + K + k + offs_k)
                    x = gelu_tanh_mul(gate, up).to(up.dtype).to(tl.float32)
                else:
                    x = tl.load(x_row + k + offs_k).to(tl.float32)
                acc += w.to(tl.float32) * x[None, :]
        y = tl.sum(acc, 1)
        tl.store(out_ptr + m * stride_om + offs_n, y.to(out_ptr.dtype.element_ty))


@triton.jit
def _rows_residual_slice(
    x_rows, res_rows, new_res_rows, k, offs_k, m_mask, write_res, HAS_RESIDUAL: tl.constexpr
):
    """x (+ residual, rounded to the dtype) over one K slice of every row, [M_PAD, BLOCK_K];
    stored as the new residual stream when write_res (one program does)."""
    h = tl.load(x_rows + k + offs_k[None, :], mask=m_mask, other=0.0)
    if HAS_RESIDUAL:
        h = add_residual(h, tl.load(res_rows + k + offs_k[None, :], mask=m_mask, other=0.0))
        if write_res:
            tl.store(new_res_rows + k + offs_k[None, :], h, mask=m_mask)
    return h


@triton.jit
def _gemv_rows_kernel(
    x_ptr, w_ptr, out_ptr, M, K, stride_xm, stride_wn, stride_om,
    res_ptr, new_res_ptr, nw_ptr, eps,
    M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr, ONE_SLICE: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    # two to four rows: every slice of W is read once for all of them (M_PAD: M rounded up
    # to a power of two)
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    offs_m = tl.arange(0, M_PAD)
    m_mask = (offs_m < M)[:, None]
    w_ptrs = w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :]
    x_rows = x_ptr + offs_m[:, None] * stride_xm
    res_rows = res_ptr + offs_m[:, None] * K
    new_res_rows = new_res_ptr + offs_m[:, None] * K
    if PROLOGUE == 1 and ONE_SLICE:
        # K fits one slice (hidden 1024): the weights are loaded first, so the time they
        # take to arrive covers the norm's loads and its sums over the rows -- and, the
        # weights being no kernel's output, under PDL the previous kernel's tail too
        w = tl.load(w_ptrs)
        wait_for_producers(PDL)
        h = _rows_residual_slice(x_rows, res_rows, new_res_rows, 0, offs_k, m_mask, pid == 0,
                                 HAS_RESIDUAL)  # fmt: skip
        x = _scaled_slice(h, row_rstd(h, K, eps)[:, None], nw_ptr, 0, offs_k)
        acc = w.to(tl.float32)[None, :, :] * x[:, None, :]
    else:
        wait_for_producers(PDL)
        rstd = tl.zeros([M_PAD], dtype=tl.float32)
        if PROLOGUE == 1:  # the rows' sums of squares first, in a pass of their own
            ss = tl.zeros([M_PAD, BLOCK_K], dtype=tl.float32)
            for k in range(0, K, BLOCK_K):
                h = _rows_residual_slice(x_rows, res_rows, x_rows, k, offs_k, m_mask, False,
                                         HAS_RESIDUAL).to(tl.float32)  # fmt: skip
                ss += h * h
            rstd = tl.rsqrt(tl.sum(ss, 1) / K + eps)
        acc = tl.zeros([M_PAD, BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            w = tl.load(w_ptrs + k)
            if PROLOGUE == 1:
                h = _rows_residual_slice(x_rows, res_rows, new_res_rows, k, offs_k, m_mask,
                                         pid == 0, HAS_RESIDUAL)  # fmt: skip
                x = _scaled_slice(h, rstd[:, None], nw_ptr, k, offs_k)
            elif PROLOGUE == 2 or PROLOGUE == 3:
                gate = tl.load(x_rows + k + offs_k[None, :], mask=m_mask, other=0.0)
                up = tl.load(x_rows + K + k + offs_k[None, :], mask=m_mask, other=0.0)
                if PROLOGUE == 2:
                    x = silu_mul(gate, up).to(up.dtype).to(tl.float32)
                else:
                    x = gelu_tanh_mul(gate, up).to(up.dtype).to(tl.float32)
            else:
                x = tl.load(x_rows + k + offs_k[None, :], mask=m_mask, other=0.0).to(tl.float32)
            acc += w.to(tl.float32)[None, :, :] * x[:, None, :]
    y = tl.sum(acc, 2)
    o_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(o_ptrs, y.to(out_ptr.dtype.element_ty), mask=m_mask)


def gemv_config(n: int, k: int) -> GemvConfig | None:
    """The measured best shape for one row (H100, Qwen3-0.6B's layers, 28 weights in turn
    so none stays in L2): 4 features per program, 1024-wide K slices where K allows, 8 warps
    when N is small (fewer programs). None when the kernel cannot tile the shape."""
    block_k = next((b for b in (1024, 512, 256) if k % b == 0), None)
    if block_k is None or n % 4:
        return None
    return GemvConfig(4, block_k, 8 if n <= 2048 else 4, 2)


def gemv_fits(cfg: GemvConfig, m: int, n: int, k: int) -> bool:
    """The kernels mask only rows: BLOCK_N must divide N and BLOCK_K divide K."""
    return 1 <= m <= MAX_ROWS and n % cfg.block_n == 0 and k % cfg.block_k == 0


def _launch(
    x: torch.Tensor, w: torch.Tensor, cfg: GemvConfig, k: int, prologue: int,
    residual: torch.Tensor | None = None, new_residual: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None, eps: float = 0.0,
) -> torch.Tensor:  # fmt: skip
    m, n = x.shape[0], w.shape[0]
    if not gemv_fits(cfg, m, n, k):
        raise ValueError(f"config {cfg} does not tile M={m}, N={n}, K={k}")
    assert x.stride(1) == 1 and w.stride(1) == 1
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    args = (
        x, w, out, k, x.stride(0), w.stride(0), out.stride(0),
        x if residual is None else residual, x if new_residual is None else new_residual,
        x if norm_weight is None else norm_weight, eps,
    )  # fmt: skip
    common = dict(
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, PROLOGUE=prologue,
        HAS_RESIDUAL=residual is not None, ONE_SLICE=k == cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl(x),
    )  # fmt: skip
    grid = (n // cfg.block_n,)
    if m == 1:
        _gemv_kernel[grid](*args, M=1, **common)
    else:
        _gemv_rows_kernel[grid](*args[:3], m, *args[3:], M_PAD=next_power_of_2(m), **common)
    return out


def gemv(x: torch.Tensor, w: torch.Tensor, cfg: GemvConfig) -> torch.Tensor:
    """x [M <= MAX_ROWS, K] @ w [N, K]^T -> [M, N] in x's dtype (float32 accumulation)."""
    return _launch(x, w, cfg, x.shape[1], _PLAIN)


def gemv_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    w: torch.Tensor,
    cfg: GemvConfig,
    new_residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """rms_norm(x + residual) @ w^T for x, residual [M <= MAX_ROWS, K] (contiguous), writing
    x + residual into `new_residual` (like x); without a residual, rms_norm(x) @ w^T."""
    if residual is not None:
        assert residual.is_contiguous() and x.is_contiguous() and new_residual is not None
    return _launch(x, w, cfg, x.shape[1], _RMS_NORM, residual, new_residual, norm_weight, eps)


def gemv_silu_mul(x: torch.Tensor, w: torch.Tensor, cfg: GemvConfig) -> torch.Tensor:
    """(silu(x[:, :K]) * x[:, K:]) @ w^T for x [M <= MAX_ROWS, 2K] (gate, then up) and w [N, K]."""
    return _launch(x, w, cfg, x.shape[1] // 2, _SILU_MUL)


def gemv_gelu_tanh_mul(x: torch.Tensor, w: torch.Tensor, cfg: GemvConfig) -> torch.Tensor:
    """(gelu_tanh(x[:, :K]) * x[:, K:]) @ w^T for x [M <= MAX_ROWS, 2K] (gate, then up), w [N, K]."""
    return _launch(x, w, cfg, x.shape[1] // 2, _GELU_MUL)


def gpu_rows(x: torch.Tensor, k: int) -> bool:
    """Whether x holds rows the GEMV takes: 16-bit rows where Triton runs (CUDA rows; the
    interpreter's CPU rows in tests), one, or up to MAX_ROWS when K is small enough that the
    GEMV beats cuBLAS for them (the module's docstring has the figures)."""
    rows = x.shape[0] if x.dim() == 2 else 0
    return (
        (rows == 1 or 1 < rows <= MAX_ROWS and k <= MAX_ROWS_K)
        and x.dtype in (torch.bfloat16, torch.float16)
        and use_triton(x)
        and x.stride(1) == 1
    )


def row_gemv_config(x: torch.Tensor, w: torch.Tensor, k: int) -> GemvConfig | None:
    """The GEMV config for x [M, *] @ w^T (K = k) when the GEMV takes x's rows, else None."""
    if not (gpu_rows(x, k) and w.stride(1) == 1 and w.shape[1] == k):
        return None
    return gemv_config(w.shape[0], k)


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x w^T + bias: the GEMV for the rows it takes on CUDA, cuBLAS otherwise."""
    cfg = row_gemv_config(x, w, x.shape[-1]) if bias is None else None
    return gemv(x, w, cfg) if cfg is not None else F.linear(x, w, bias)
