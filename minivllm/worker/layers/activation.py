"""The SwiGLU activation of a gate_up projection's output."""

from __future__ import annotations

import torch
from torch import nn

from minivllm.worker.ops.activation import silu_and_mul
from minivllm.worker.ops.gemv import RowPrologue, one_gpu_row


class SiluAndMul(nn.Module):
    """silu(x[..., :d]) * x[..., d:] for x [..., 2d] (gate, then up). One CUDA row is handed
    to the linear after it as a `RowPrologue`, whose GEMV computes it: one kernel, not two."""

    def forward(self, x: torch.Tensor) -> torch.Tensor | RowPrologue:
        return RowPrologue(x) if one_gpu_row(x) else silu_and_mul(x)
