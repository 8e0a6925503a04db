"""The interface every attention backend implements."""

from __future__ import annotations

from typing import Protocol

import torch

from minivllm.worker.attention.metadata import AttentionMetadata


class AttentionBackend(Protocol):
    """Stores a step's keys/values into a layer's paged cache, and attends over the cache.

    The attention layer (layer.py) calls `store_kv`, then `forward`; where `store_kv` is
    `triton_attention.store_kv_cache`, the rotary kernel may do the same writes in its own
    pass instead (`layers.fused.qk_norm_rope_store_kv`). `kv_scale` (float32 [2]: the layer's
    k and v scales) is read only by an FP8 cache (ops/kv_cache.py), which needs it.

    `sliding_window` W (the layer's, fixed when the model is built): the query at position p
    attends to the keys at p - W + 1 .. p only. A backend must not read the cache behind the
    window: the engine-core may have given those blocks to other requests."""

    def store_kv(
        self,
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        slot_mapping: torch.Tensor,  # [num_tokens] flat slots; -1: not stored
        kv_scale: torch.Tensor | None = None,
    ) -> None: ...

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        kv_cache: torch.Tensor,  # with this step's keys/values stored
        meta: AttentionMetadata,
        scale: float,
        kv_scale: torch.Tensor | None = None,
        sliding_window: int | None = None,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        ...
