"""The attention layer of a model: stores the step's keys and values into the layer's paged
KV cache, then attends over it through the backend. The batch's metadata and KV caches come
from the forward batch in scope (`forward_batch`), which the model enters once per forward."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from minivllm.worker.attention.backend import AttentionBackend
from minivllm.worker.attention.metadata import AttentionMetadata
from minivllm.worker.attention.triton_attention import store_kv_cache
from minivllm.worker.layers.rotary import PendingRotation
from minivllm.worker.ops._triton import HAS_TRITON
from minivllm.worker.ops.kv_cache import calculate_kv_scales


@dataclass(frozen=True)
class ForwardBatch:
    """What every attention layer of one forward reads: the batch layout and, per layer,
    its KV cache [2, num_blocks, block_size, num_kv_heads, head_dim]."""

    meta: AttentionMetadata
    kv_caches: list[torch.Tensor]


_current: ForwardBatch | None = None


@contextmanager
def forward_batch(meta: AttentionMetadata, kv_caches: list[torch.Tensor]) -> Iterator[None]:
    """Makes this batch the one the attention layers read, for the block; does not nest."""
    global _current
    if _current is not None:
        raise RuntimeError("a forward batch is already in scope: forwards do not nest")
    _current = ForwardBatch(meta, kv_caches)
    try:
        yield
    finally:
        _current = None


class PagedAttention(nn.Module):
    """Attention of layer `layer_idx` over its paged KV cache.

    On CUDA, q and k come as a `PendingRotation`. The rotary kernel writes k and v into the
    cache exactly as `store_kv_cache` does, so where the backend stores with that kernel
    (Triton, flash-attn), rotation and store are one pass and the backend only attends;
    elsewhere (the torch reference) the rotation runs alone and the backend stores.

    `kv_scale` holds the layer's k and v scales for an FP8 cache (ops/kv_cache.py): the
    checkpoint's, or those the step with `meta.compute_kv_scales` sets from its rotated keys
    and values (kv_scales.py), else 1.0."""

    def __init__(self, layer_idx: int, backend: AttentionBackend, scale: float) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.backend = backend
        self.scale = scale
        self.rotary_stores_kv = HAS_TRITON and backend.store_kv is store_kv_cache
        self.register_buffer("kv_scale", torch.ones(2, dtype=torch.float32))

    def forward(
        self,
        q: torch.Tensor | PendingRotation,
        k: torch.Tensor | PendingRotation,
        v: torch.Tensor,
    ) -> torch.Tensor:
        """q [T, heads, head_dim], k and v [T, kv_heads, head_dim] -> [T, heads, head_dim]."""
        if _current is None:
            raise RuntimeError("attention outside a forward batch (see forward_batch)")
        meta, kv_cache = _current.meta, _current.kv_caches[self.layer_idx]
        fuse = self.rotary_stores_kv and not meta.compute_kv_scales
        if isinstance(q, PendingRotation) and fuse:
            q, k = q.apply(v, kv_cache, meta.slot_mapping, self.kv_scale)
        else:
            if isinstance(q, PendingRotation):
                q, k = q.apply()
            if meta.compute_kv_scales:
                n = meta.num_tokens
                calculate_kv_scales(k[:n], v[:n], self.kv_scale)
            self.backend.store_kv(k, v, kv_cache, meta.slot_mapping, self.kv_scale)
        return self.backend.forward(q, kv_cache, meta, self.scale, self.kv_scale)
