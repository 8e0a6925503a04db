"""RMSNorm over the residual stream of a decoder."""

from __future__ import annotations

import torch
from torch import nn

from minivllm.worker.distributed.parallel_state import PartialSum
from minivllm.worker.ops.gemv import RowPrologue, one_gpu_row
from minivllm.worker.ops.norm import add_rms_norm


class RMSNorm(nn.Module):
    """(norm(x + residual), x + residual): the normed input of the next block and the new
    residual stream; without a residual (norm(x), x), the stream starting at x.

    The fused kernels are chosen here, from what x is: a row-parallel layer's `PartialSum` is
    summed over the TP ranks in the same kernel as the add and the norm; with `feeds_linear`
    (the norm's output goes only into a linear layer), one CUDA row is returned as a
    `RowPrologue` for that linear's GEMV to norm itself (its new residual written by it too)."""

    def __init__(
        self,
        hidden_size: int,
        eps: float,
        params_dtype: torch.dtype | None = None,
        feeds_linear: bool = False,
    ) -> None:
        super().__init__()
        self.eps = eps
        self.feeds_linear = feeds_linear
        self.weight = nn.Parameter(
            torch.empty(hidden_size, dtype=params_dtype), requires_grad=False
        )

    def forward(
        self, x: torch.Tensor | PartialSum, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor | RowPrologue, torch.Tensor]:
        if isinstance(x, PartialSum):
            return x.tp.all_reduce_add_rms_norm(x.partial, residual, self.weight, self.eps)
        if self.feeds_linear and one_gpu_row(x):
            if residual is None:
                return RowPrologue(x, self.weight, self.eps), x
            if x.is_contiguous() and residual.is_contiguous():
                new_residual = torch.empty_like(x)
                prologue = RowPrologue(x, self.weight, self.eps, residual, new_residual)
                return prologue, new_residual
        return add_rms_norm(x, residual, self.weight, self.eps)
