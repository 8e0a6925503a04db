"""RMSNorm and fused residual-add + RMSNorm (one read of x and residual, one write of each).

Numerics follow HF transformers: the residual sum is rounded to the input dtype, the norm is
computed in float32, rounded to the input dtype, then multiplied by the weight.
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


@triton.jit
def add_residual(x, res):
    """x + residual as HF rounds it: summed in float32, rounded to x's dtype. Every kernel
    that adds the residual stream uses this, so fused paths stay bit-equal to this file's."""
    return (x.to(tl.float32) + res.to(tl.float32)).to(x.dtype)


@triton.jit
def row_rstd(x, n_cols, eps):
    """1 / sqrt(mean(x^2) + eps) over a row held whole (masked lanes zero), in float32; for
    rows [M, n_cols], each row's, [M]."""
    xf = x.to(tl.float32)
    return tl.rsqrt(tl.sum(xf * xf, -1) / n_cols + eps)


@triton.jit
def rms_scale(x, rstd, w):
    """RMSNorm's output before its final rounding, as HF computes it: x * rstd rounded to
    x's dtype, times the weight, in float32."""
    return (x.to(tl.float32) * rstd).to(x.dtype).to(tl.float32) * w.to(tl.float32)


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, new_res_ptr,
    stride_x, stride_res, stride_out, stride_new_res, n_cols, eps,
    BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    wait_for_producers(PDL)
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x = add_residual(x, tl.load(res_ptr + row * stride_res + offs, mask=mask, other=0.0))
        tl.store(new_res_ptr + row * stride_new_res + offs, x, mask=mask)
    rstd = row_rstd(x, n_cols, eps)
    y = rms_scale(x, rstd, tl.load(w_ptr + offs, mask=mask, other=0.0))
    tl.store(out_ptr + row * stride_out + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def norm_warps(block: int) -> int:
    """Warps for a row block. Kernels that must match this one bit for bit (the TP
    all-reduce fused with the norm) use the same: other warps reduce in another order."""
    return min(16, max(1, block // 256))


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, last dim] with unit stride along a row (a view where it can be)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _launch(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    new_res: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    x2 = as_rows(x)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out2 = out.view(-1, x.shape[-1])
    res2 = new_res2 = None
    if residual is not None:
        res2 = as_rows(residual)
        if new_res is None:
            new_res = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        new_res2 = new_res.view(-1, x.shape[-1])
    n_cols = x.shape[-1]
    block = next_power_of_2(n_cols)
    _rms_norm_kernel[(x2.shape[0],)](
        x2, x2 if res2 is None else res2, weight, out2, out2 if new_res2 is None else new_res2,
        x2.stride(0), 0 if res2 is None else res2.stride(0), out2.stride(0),
        0 if new_res2 is None else new_res2.stride(0), n_cols, eps,
        BLOCK=block, HAS_RESIDUAL=residual is not None, num_warps=norm_warps(block), **pdl(x2),
    )  # fmt: skip
    return out, new_res


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def fused_add_rms_norm_torch(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    new_residual = x + residual
    return rms_norm_torch(new_residual, weight, eps), new_residual


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * weight over the last dimension; a new tensor."""
    if not use_triton(x):
        return rms_norm_torch(x, weight, eps)
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    new_residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual), both new tensors (the inputs are not modified);
    x + residual goes into `new_residual` when given (contiguous, like x)."""
    if not use_triton(x):
        out, new = fused_add_rms_norm_torch(x, residual, weight, eps)
        return out, new if new_residual is None else new_residual.copy_(new)
    out, new_residual = _launch(x, residual, weight, eps, new_residual)
    assert new_residual is not None
    return out, new_residual


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`fused_add_rms_norm`, or without a residual (rms_norm(x), x): a decoder's norm and
    the residual stream after it, whether or not a stream exists yet."""
    if residual is None:
        return rms_norm(x, weight, eps), x
    return fused_add_rms_norm(x, residual, weight, eps)
