"""One layer's attention as a model runs it, for the backend tests."""

from __future__ import annotations

import torch

from minivllm.worker.attention.backend import AttentionBackend
from minivllm.worker.attention.layer import PagedAttention, forward_batch
from minivllm.worker.attention.metadata import AttentionMetadata


def attend(
    backend: AttentionBackend,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    kv_scale: torch.Tensor | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Store k/v into kv_cache at meta.slot_mapping, then attend: `PagedAttention` of the
    only layer (with an FP8 cache's `kv_scale`, a sliding window), in a forward batch of its
    cache."""
    layer = PagedAttention(0, backend, scale, sliding_window).to(q.device)
    if kv_scale is not None:
        layer.kv_scale.copy_(kv_scale)
    with forward_batch(meta, [kv_cache]):
        layer.store_kv(k, v)
        return layer(q)
