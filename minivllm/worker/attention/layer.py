"""The attention layer of a model: stores the step's keys and values into the layer's paged
KV cache (`store_kv`), and attends over the cache (`forward`). The batch's metadata and KV
caches come from the forward batch in scope (`forward_batch`), which the model enters once
per forward."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from minivllm.worker.attention.backend import AttentionBackend
from minivllm.worker.attention.metadata import AttentionMetadata
from minivllm.worker.attention.triton_attention import store_kv_cache
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

    A step calls `store_kv(k, v)`, then `forward(q)`. Where the backend stores with
    `store_kv_cache` (Triton, flash-attn), the rotary kernel can write the cache exactly as
    that store does, in its own pass (`rope_can_store_kv`; `layers.fused.qk_norm_rope_store_kv`
    decides), and the step skips `store_kv`.

    `kv_scale` holds the layer's k and v scales for an FP8 cache (ops/kv_cache.py): the
    checkpoint's, or those the step with `meta.compute_kv_scales` sets from its rotated keys
    and values (kv_scales.py), else 1.0.

    `sliding_window` W: each query attends to the W keys up to its own position only (see
    sliding_windows.py); None: to its whole context."""

    def __init__(
        self,
        layer_idx: int,
        backend: AttentionBackend,
        scale: float,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.backend = backend
        self.scale = scale
        self.sliding_window = sliding_window
        self.rope_can_store_kv = HAS_TRITON and backend.store_kv is store_kv_cache
        self.register_buffer("kv_scale", torch.ones(2, dtype=torch.float32))

    def batch_and_cache(self) -> tuple[AttentionMetadata, torch.Tensor]:
        """The forward batch's metadata and this layer's KV cache."""
        if _current is None:
            raise RuntimeError("attention outside a forward batch (see forward_batch)")
        return _current.meta, _current.kv_caches[self.layer_idx]

    def store_kv(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """k and v [T, kv_heads, head_dim] into the cache at the batch's slot mapping; on the
        step that computes the FP8 scales, the scales from k and v first."""
        meta, kv_cache = self.batch_and_cache()
        if meta.compute_kv_scales:
            n = meta.num_tokens
            calculate_kv_scales(k[:n], v[:n], self.kv_scale)
        self.backend.store_kv(k, v, kv_cache, meta.slot_mapping, self.kv_scale)

    def forward(self, q: torch.Tensor) -> torch.Tensor:
        """q [T, heads, head_dim] -> [T, heads, head_dim], attending over the cache, which
        holds this step's keys and values."""
        meta, kv_cache = self.batch_and_cache()
        return self.backend.forward(
            q, kv_cache, meta, self.scale, self.kv_scale, self.sliding_window
        )
