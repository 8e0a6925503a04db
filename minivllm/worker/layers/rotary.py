"""Rotary position embedding (NeoX / HF rotate_half layout) with a precomputed cos/sin table."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from minivllm.worker.layers import ops
from minivllm.worker.layers.norm import RMSNorm
from minivllm.worker.ops._triton import HAS_TRITON
from minivllm.worker.ops.rotary import build_cos_sin_cache, qk_norm_rope

_SUPPORTED_ROPE_TYPES = ("default", "llama3")


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
    """Rotates q and k by their token positions, after the optional per-head q/k RMSNorm
    (Qwen3). One table of cos|sin for every position up to max_positions, float32, built once
    and shared by all layers. On CUDA, norm and rotation are one in-place kernel, which can
    also write the layer's k/v into its KV cache."""

    def __init__(self, head_dim: int, max_positions: int, hf_config: dict[str, Any]) -> None:
        super().__init__()
        theta, scaling = rope_parameters(hf_config)
        table = build_cos_sin_cache(
            max_positions, head_dim, theta, torch.float32, torch.get_default_device(), scaling
        )
        self.register_buffer("cos_sin_cache", table, persistent=False)

    @staticmethod
    def can_store_kv(q: torch.Tensor) -> bool:
        """Whether `forward` on tensors like q can also store k/v (the Triton kernel)."""
        return q.is_cuda and HAS_TRITON

    def forward(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        q_norm: RMSNorm | None = None,
        k_norm: RMSNorm | None = None,
        v: torch.Tensor | None = None,
        kv_cache: torch.Tensor | None = None,
        slot_mapping: torch.Tensor | None = None,
        kv_scale: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T]; q [T, heads, head_dim]; k [T, kv_heads, head_dim]. Given v, kv_cache
        and slot_mapping (only where `can_store_kv`), the rotated k and v also go into
        kv_cache at slot_mapping, as `ops.rotary.qk_norm_rope` describes."""
        if kv_cache is not None and not self.can_store_kv(q):
            raise ValueError("the rotary kernel stores k/v only on CUDA with triton")
        if q.is_cuda:
            apply_norm = q_norm is not None and k_norm is not None
            qk_norm_rope(
                q,
                k,
                q_norm.weight if apply_norm else None,
                k_norm.weight if apply_norm else None,
                self.cos_sin_cache,
                positions,
                q_norm.eps if apply_norm else 0.0,
                apply_norm,
                v,
                kv_cache,
                slot_mapping,
                kv_scale,
            )
            return q, k
        if q_norm is not None and k_norm is not None:
            q, k = q_norm(q), k_norm(k)
        cos, sin = self.cos_sin_cache[positions].chunk(2, dim=-1)
        return ops.apply_rope(q, k, cos, sin)
