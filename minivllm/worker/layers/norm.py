"""RMSNorm, over a decoder's residual stream or over each attention head (Qwen3's q/k norm);
Gemma's, whose weight is stored as its offset from 1."""

from __future__ import annotations

import torch
from torch import nn

from minivllm.worker.ops.gemma_norm import gemma_rms_norm
from minivllm.worker.ops.norm import fused_add_rms_norm, rms_norm


class RMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) * weight over the last dimension; given a residual,
    (rms_norm(x + residual), x + residual): the normed input of the next block and the new
    residual stream, in one kernel.

    A decoder runs its norms inside the fused ops of layers/fused.py, which read `weight` and
    `eps` (and may run the norm inside the kernel after it)."""

    weight_offset = False  # Gemma's: the norm multiplies by 1 + weight

    def __init__(
        self, hidden_size: int, eps: float, params_dtype: torch.dtype | None = None
    ) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(
            torch.empty(hidden_size, dtype=params_dtype), requires_grad=False
        )

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return fused_add_rms_norm(x, residual, self.weight, self.eps)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: x * rsqrt(mean(x^2) + eps) * (1 + weight), in float32 and rounded
    once (ops/gemma_norm.py); checkpoints store the weight as its offset from 1."""

    weight_offset = True

    def forward(self, x: torch.Tensor, residual: None = None) -> torch.Tensor:  # type: ignore[override]
        if residual is not None:
            raise ValueError("GemmaRMSNorm adds no residual: see layers.fused.norm_add_norm")
        return gemma_rms_norm(x, self.weight, self.eps)
