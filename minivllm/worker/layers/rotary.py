"""Rotary position embedding (NeoX / HF rotate_half layout)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from minivllm.worker.ops.rotary import build_cos_sin_cache, qk_norm_rope

_SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear")


def rope_parameters(hf_config: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """(rope_theta, scaling dict) from either config layout: transformers 5 writes
    `rope_parameters`, older checkpoints a top-level `rope_theta` plus `rope_scaling`."""
    params = dict(hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", hf_config.get("rope_theta", 10000.0)))
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    if params["rope_type"] not in _SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope type {params['rope_type']!r} is not supported; "
            f"supported: {', '.join(_SUPPORTED_ROPE_TYPES)}"
        )
    return theta, params


class RotaryEmbedding(nn.Module):
    """Rotates q and k by their token positions, from one table of cos|sin for every
    position up to max_positions, float32, built once and shared by all layers.

    A decoder rotates inside `layers.fused.qk_norm_rope_store_kv`, which reads
    `cos_sin_cache` (and may norm each head first and store k and v in the same kernel)."""

    def __init__(self, head_dim: int, max_positions: int, hf_config: dict[str, Any]) -> None:
        super().__init__()
        theta, scaling = rope_parameters(hf_config)
        table = build_cos_sin_cache(
            max_positions, head_dim, theta, torch.float32, torch.get_default_device(), scaling
        )
        self.register_buffer("cos_sin_cache", table, persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T]; q [T, heads, head_dim]; k [T, kv_heads, head_dim]: rotated in place
        and returned."""
        qk_norm_rope(q, k, None, None, self.cos_sin_cache, positions, 0.0, False)
        return q, k
