"""The prologues a batch-1 GEMV runs on its input row instead of a kernel of their own: the
(residual-add +) RMSNorm of the row, or SiLU(gate) * up / GELU-tanh(gate) * up of a gate_up
row. The 16-bit GEMV (gemv.py), the FP8 GEMV (fp8_gemm.py) and the INT4 GEMV (w4a16.py) call
these on the K columns they read, so every prologue rounds exactly as the separate kernels
round what they store (norm.py, activation.py).

Every program of a GEMV recomputes its row's prologue (a few KB read from L1/L2); program 0
also writes the new residual stream.
"""

from __future__ import annotations

from minivllm.worker.ops._triton import tl, triton
from minivllm.worker.ops.activation import gelu_tanh_mul, silu_mul
from minivllm.worker.ops.norm import add_residual, rms_scale

# what a GEMV computes its x from (the kernels' PROLOGUE)
PLAIN, RMS_NORM, SILU_MUL, GELU_MUL = 0, 1, 2, 3


@triton.jit
def residual_slice(x_row, res_row, new_res_row, cols, write_res, HAS_RESIDUAL: tl.constexpr):
    """x (+ residual, rounded to the dtype) at `cols`; stored as the new residual stream when
    write_res (one program does)."""
    h = tl.load(x_row + cols)
    if HAS_RESIDUAL:
        h = add_residual(h, tl.load(res_row + cols))
        if write_res:
            tl.store(new_res_row + cols, h)
    return h


@triton.jit
def scaled_slice(h, rstd, nw_ptr, cols):
    """RMSNorm's output at `cols` as ops/norm.py rounds it, in float32 for the dot."""
    return rms_scale(h, rstd, tl.load(nw_ptr + cols)).to(h.dtype).to(tl.float32)


@triton.jit
def row_rstd_pass(x_row, res_row, K, eps, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    """1 / sqrt(mean((x + residual)^2) + eps) over the row, in a pass of its own (BLOCK
    divides K)."""
    offs = tl.arange(0, BLOCK)
    ss = tl.zeros([BLOCK], dtype=tl.float32)
    for k in range(0, K, BLOCK):
        hf = residual_slice(x_row, res_row, x_row, k + offs, False, HAS_RESIDUAL).to(tl.float32)
        ss += hf * hf
    return tl.rsqrt(tl.sum(ss, 0) / K + eps)


@triton.jit
def prologue_slice(
    x_row, res_row, new_res_row, nw_ptr, K, cols, rstd, write_res,
    PROLOGUE: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):  # fmt: skip
    """The GEMV's input at `cols` (any shape of column offsets), in float32, rounded to the
    activation dtype first as the separate kernel would store it. K: the row's width (of
    gate_up: the width of gate)."""
    if PROLOGUE == 1:
        h = residual_slice(x_row, res_row, new_res_row, cols, write_res, HAS_RESIDUAL)
        x = scaled_slice(h, rstd, nw_ptr, cols)
    elif PROLOGUE == 2:
        up = tl.load(x_row + K + cols)
        x = silu_mul(tl.load(x_row + cols), up).to(up.dtype).to(tl.float32)
    elif PROLOGUE == 3:
        up = tl.load(x_row + K + cols)
        x = gelu_tanh_mul(tl.load(x_row + cols), up).to(up.dtype).to(tl.float32)
    else:
        x = tl.load(x_row + cols).to(tl.float32)
    return x
