"""Gemma's RMSNorm, and the pair of norms around each of its residual adds.

Gemma stores the norm's weight as its offset from 1 and multiplies in float32 before the one
rounding to the activation dtype: x * rsqrt(mean(x^2) + eps) * (1 + w), where Llama's RMSNorm
(ops/norm.py) rounds x * rsqrt(...) first and multiplies by w after.

A Gemma 3 block norms the output of attention (and of the MLP) before adding it to the
residual stream, then norms the new stream for the next projection: `gemma_norm_add_norm`
does the two norms and the add in one kernel, one read of each input and one write of each
output.
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
from minivllm.worker.ops.norm import add_residual, as_rows, norm_warps, row_rstd


@triton.jit
def _gemma_scale(x, rstd, w):
    """Gemma's norm of a row before its rounding, in float32: x * rstd * (1 + w)."""
    return x.to(tl.float32) * rstd * (1.0 + w.to(tl.float32))


@triton.jit
def _gemma_norm_kernel(
    x_ptr, res_ptr, post_w_ptr, w_ptr, out_ptr, new_res_ptr,
    stride_x, stride_res, stride_out, stride_new_res, n_cols, eps,
    BLOCK: tl.constexpr, SANDWICH: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    wait_for_producers(PDL)
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if SANDWICH:  # residual + post_norm(x): the new residual stream
        post_w = tl.load(post_w_ptr + offs, mask=mask, other=0.0)
        y = _gemma_scale(x, row_rstd(x, n_cols, eps), post_w).to(x.dtype)
        x = add_residual(y, tl.load(res_ptr + row * stride_res + offs, mask=mask, other=0.0))
        tl.store(new_res_ptr + row * stride_new_res + offs, x, mask=mask)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    out = _gemma_scale(x, row_rstd(x, n_cols, eps), w)
    tl.store(out_ptr + row * stride_out + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def gemma_rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (x32 * (1.0 + weight.float())).to(x.dtype)


def _launch(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    post_weight: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    n_cols = x.shape[-1]
    x2 = as_rows(x)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out2 = out.view(-1, n_cols)
    new_res = new_res2 = res2 = None
    if residual is not None:
        res2 = as_rows(residual)
        new_res = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        new_res2 = new_res.view(-1, n_cols)
    block = next_power_of_2(n_cols)
    _gemma_norm_kernel[(x2.shape[0],)](
        x2, x2 if res2 is None else res2, weight if post_weight is None else post_weight, weight,
        out2, out2 if new_res2 is None else new_res2,
        x2.stride(0), 0 if res2 is None else res2.stride(0), out2.stride(0),
        0 if new_res2 is None else new_res2.stride(0), n_cols, eps,
        BLOCK=block, SANDWICH=residual is not None, num_warps=norm_warps(block), **pdl(x2),
    )  # fmt: skip
    return out, new_res


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * (1 + weight) over the last dimension, in float32, rounded
    once to x's dtype; a new tensor."""
    if not use_triton(x):
        return gemma_rms_norm_torch(x, weight, eps)
    return _launch(x, None, None, weight, eps)[0]


def gemma_norm_add_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    post_weight: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(s, weight), s) with s = residual + norm(x, post_weight), Gemma's norms: a block's
    output joining the residual stream, and the next projection's input. New tensors."""
    if not use_triton(x):
        s = residual + gemma_rms_norm_torch(x, post_weight, eps)
        return gemma_rms_norm_torch(s, weight, eps), s
    out, new_res = _launch(x, residual, post_weight, weight, eps)
    assert new_res is not None
    return out, new_res
