"""RMSNorm, with the residual-add variant the decoder layers use."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from minivllm.worker.layers import ops

if TYPE_CHECKING:
    from minivllm.worker.layers.linear import ColumnParallelLinear
    from minivllm.worker.layers.parallel_state import TPGroup


class RMSNorm(nn.Module):
    """norm(x) or, given a residual, (norm(x + residual), x + residual).

    With `tp` (size > 1) x is a row-parallel layer's partial sum: it is summed over the
    ranks first, in the same kernel as the add and the norm where the group can."""

    def __init__(self, hidden_size: int, eps: float, params_dtype: torch.dtype | None = None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(
            torch.empty(hidden_size, dtype=params_dtype), requires_grad=False
        )

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None, tp: TPGroup | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if tp is not None and tp.size > 1:
            normed, new_residual = tp.all_reduce_add_rms_norm(x, residual, self.weight, self.eps)
            return normed if residual is None else (normed, new_residual)
        if residual is None:
            return ops.rms_norm(x, self.weight, self.eps)
        return ops.fused_add_rms_norm(x, residual, self.weight, self.eps)

    def then_linear(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        linear: ColumnParallelLinear,
        tp: TPGroup | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(linear(norm(x + residual)), x + residual), x summed over `tp` first as in forward;
        without a residual, (linear(norm(x)), x). At batch 1 on one GPU the norm runs inside
        the linear's GEMV: one kernel instead of two."""
        if tp is not None and tp.size > 1:
            normed, residual = tp.all_reduce_add_rms_norm(x, residual, self.weight, self.eps)
            return linear(normed), residual
        return ops.rms_norm_linear(x, residual, self.weight, self.eps, linear.weight, linear.bias)
