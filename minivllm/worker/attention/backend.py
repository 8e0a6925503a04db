"""The interface every attention backend implements."""

from __future__ import annotations

from typing import Protocol

import torch

from minivllm.worker.attention.metadata import AttentionMetadata


class AttentionBackend(Protocol):
    """Stores this step's keys/values into the paged cache, then attends over it."""

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        ...
