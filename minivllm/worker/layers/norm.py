"""RMSNorm, with the residual-add variant the decoder layers use."""

from __future__ import annotations

import torch
from torch import nn

from minivllm.worker.layers import ops


class RMSNorm(nn.Module):
    """norm(x) or, given a residual, (norm(x + residual), x + residual)."""

    def __init__(self, hidden_size: int, eps: float, params_dtype: torch.dtype | None = None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(
            torch.empty(hidden_size, dtype=params_dtype), requires_grad=False
        )

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return ops.rms_norm(x, self.weight, self.eps)
        return ops.fused_add_rms_norm(x, residual, self.weight, self.eps)
