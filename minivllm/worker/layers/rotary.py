"""Rotary position embedding (NeoX / HF rotate_half layout), over the first `rotary_dim`
dims of each head (all of them, or partial_rotary_factor of them)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from minivllm.rope_config import rope_parameters, rotary_dim
from minivllm.worker.ops.rotary import build_cos_sin_cache, qk_norm_rope


class RotaryEmbedding(nn.Module):
    """Rotates q and k by their token positions, from one table of cos|sin for every
    position up to max_positions, float32, built once and shared by all layers, with the
    scaling config.json asks for (`rope_config.rope_parameters`).

    A position indexes a row of the table; LongRoPE's table holds the short factors' rows,
    then the long ones': the model runner gives each token of a sequence longer than
    original_max_position_embeddings its position plus that length (see
    `ops.rotary.build_cos_sin_cache`).

    A decoder rotates inside `layers.fused.qk_norm_rope_store_kv`, which reads
    `cos_sin_cache` (and may norm each head first and store k and v in the same kernel)."""

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        hf_config: dict[str, Any],
        layer_type: str | None = None,
    ) -> None:
        """`layer_type` picks the settings of those layers where config.json gives them per
        layer type (Gemma 3's "sliding_attention" and "full_attention")."""
        super().__init__()
        rope = rope_parameters(hf_config, layer_type)
        self.rotary_dim = rotary_dim(head_dim, rope)
        table = build_cos_sin_cache(
            max_positions,
            self.rotary_dim,
            rope["rope_theta"],
            torch.float32,
            torch.get_default_device(),
            rope,
        )
        self.register_buffer("cos_sin_cache", table, persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T]; q [T, heads, head_dim]; k [T, kv_heads, head_dim]: rotated in place
        and returned."""
        qk_norm_rope(q, k, None, None, self.cos_sin_cache, positions, 0.0, False)
        return q, k
