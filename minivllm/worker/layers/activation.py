"""The gated activation of the MLP."""

from __future__ import annotations

import torch
from torch import nn

from minivllm.worker.layers import ops


class SiluAndMul(nn.Module):
    """[..., 2 * d] (gate, up) -> [..., d]: silu(gate) * up."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.silu_and_mul(x)
