"""Rotary position embedding (NeoX / HF rotate_half layout), with Qwen3's per-head q/k norm."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import nn

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


class HeadRMSNorm(nn.Module):
    """RMSNorm over each attention head's vector (Qwen3's q_norm and k_norm). The rotary
    embedding after it applies it, in the same pass as the rotation (one kernel on CUDA): x
    comes back as `HeadNormed`."""

    def __init__(self, head_dim: int, eps: float, params_dtype: torch.dtype | None = None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(head_dim, dtype=params_dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> HeadNormed:
        return HeadNormed(x, self.weight, self.eps)


class HeadNormed(NamedTuple):
    """q or k [T, heads, head_dim] still to be normed per head with `weight`."""

    x: torch.Tensor
    weight: torch.Tensor
    eps: float


QK = torch.Tensor | HeadNormed


class RotaryEmbedding(nn.Module):
    """Rotates q and k by their token positions, from one table of cos|sin for every
    position up to max_positions, float32, built once and shared by all layers. q and k given
    as `HeadNormed` are normed per head first, in the same pass.

    On CUDA the rotation is left to the attention layer, as a `PendingRotation`: one kernel
    there norms, rotates and writes k and v into the KV cache."""

    def __init__(self, head_dim: int, max_positions: int, hf_config: dict[str, Any]) -> None:
        super().__init__()
        theta, scaling = rope_parameters(hf_config)
        table = build_cos_sin_cache(
            max_positions, head_dim, theta, torch.float32, torch.get_default_device(), scaling
        )
        self.register_buffer("cos_sin_cache", table, persistent=False)

    def forward(
        self, positions: torch.Tensor, q: QK, k: QK
    ) -> tuple[torch.Tensor, torch.Tensor] | tuple[PendingRotation, PendingRotation]:
        """positions [T]; q [T, heads, head_dim]; k [T, kv_heads, head_dim]."""
        pending = PendingRotation(positions, q, k, self.cos_sin_cache)
        if (q.x if isinstance(q, HeadNormed) else q).is_cuda:
            return pending, pending
        return pending.apply()


class PendingRotation(NamedTuple):
    """q and k still to be rotated at `positions` (see RotaryEmbedding); both at once."""

    positions: torch.Tensor
    q: QK
    k: QK
    cos_sin_cache: torch.Tensor

    def apply(
        self,
        v: torch.Tensor | None = None,
        kv_cache: torch.Tensor | None = None,
        slot_mapping: torch.Tensor | None = None,
        kv_scale: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Norms (for `HeadNormed`) and rotates q and k in place and returns them. Given v,
        kv_cache and slot_mapping (and an FP8 cache's kv_scale), the rotated k and v also go
        into kv_cache at slot_mapping in the same pass, as `ops.rotary.qk_norm_rope`
        describes."""
        q, k = self.q, self.k
        store = (v, kv_cache, slot_mapping, kv_scale)
        if not isinstance(q, HeadNormed):
            qk_norm_rope(q, k, None, None, self.cos_sin_cache, self.positions, 0.0, False,
                         *store)  # fmt: skip
            return q, k
        qk_norm_rope(q.x, k.x, q.weight, k.weight, self.cos_sin_cache, self.positions, q.eps,
                     True, *store)  # fmt: skip
        return q.x, k.x
