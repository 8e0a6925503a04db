"""The interface every attention backend implements."""

from __future__ import annotations

from typing import Protocol

import torch

from minivllm.worker.attention.metadata import AttentionMetadata


class AttentionBackend(Protocol):
    """Stores this step's keys/values into the paged cache, then attends over it.

    The store may be done before `forward` instead: where `fuses_kv_store` is True, a layer
    on CUDA has its rotary kernel write the rotated k and the v into `kv_cache` at
    `meta.slot_mapping` (the same values, in the cache's dtype) and passes `kv_stored=True`,
    saving the backend's store kernel. Backends whose own store reads the slots on the host
    (the torch reference, the CPU backend) set it False, so layers leave the store to them.
    """

    fuses_kv_store: bool

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        scale: float,
        kv_stored: bool = False,  # True: k/v are in kv_cache already, do not store them
        # float32 [2], the layer's k and v scales; needed by an FP8 cache (ops/kv_cache.py)
        kv_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        ...
