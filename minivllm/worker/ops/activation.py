"""Gated MLP activations over a fused [T, 2I] gate_up projection: SwiGLU's silu(gate) * up,
and GeGLU's gelu_tanh(gate) * up (Gemma's `gelu_pytorch_tanh`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minivllm.worker.ops._triton import pdl, tl, triton, use_triton, wait_for_producers

_BLOCK = 1024


@triton.jit
def silu_mul(gate, up):
    """silu(gate) * up as torch rounds it (F.silu stores in up's dtype), in float32 for the
    caller to round. The GEMV's SiLU prologue uses it too, so both paths agree bit for bit."""
    gate = gate.to(tl.float32)
    act = (gate * tl.sigmoid(gate)).to(up.dtype).to(tl.float32)
    return act * up.to(tl.float32)


@triton.jit
def gelu_tanh_mul(gate, up):
    """gelu(gate, approximate="tanh") * up as torch rounds it, in float32 for the caller to
    round; 0.5 * (1 + tanh(y)) is sigmoid(2y). The GEMV's GELU prologue uses it too."""
    gate = gate.to(tl.float32)
    inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)  # sqrt(2 / pi)
    act = (gate * tl.sigmoid(2.0 * inner)).to(up.dtype).to(tl.float32)
    return act * up.to(tl.float32)


@triton.jit
def _act_and_mul_kernel(
    x_ptr, out_ptr, stride_x, stride_out, n_cols, BLOCK: tl.constexpr, GELU: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    wait_for_producers(PDL)
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_cols
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + n_cols + offs, mask=mask, other=0.0)
    y = gelu_tanh_mul(gate, up) if GELU else silu_mul(gate, up)
    tl.store(out_ptr + row * stride_out + offs, y.to(up.dtype), mask=mask)


def silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def gelu_tanh_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    return F.gelu(x[..., :d], approximate="tanh") * x[..., d:]


def _launch(x: torch.Tensor, gelu: bool) -> torch.Tensor:
    d = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * d)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty((*x.shape[:-1], d), dtype=x.dtype, device=x.device)
    out2 = out.view(-1, d)
    grid = (x2.shape[0], triton.cdiv(d, _BLOCK))
    _act_and_mul_kernel[grid](
        x2, out2, x2.stride(0), out2.stride(0), d, BLOCK=_BLOCK, GELU=gelu, **pdl(x2)
    )
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[..., :I]) * x[..., I:] for x of last dimension 2I (gate first, then up)."""
    if not use_triton(x):
        return silu_and_mul_torch(x)
    return _launch(x, gelu=False)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(x[..., :I]) * x[..., I:] for x of last dimension 2I (gate first, then up)."""
    if not use_triton(x):
        return gelu_tanh_and_mul_torch(x)
    return _launch(x, gelu=True)
