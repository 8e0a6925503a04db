"""Paged attention through the `flash_attn` package (FlashAttention-2, >= 2.6).

The KV cache layout `[2, num_blocks, block_size, num_kv_heads, head_dim]` already holds
flash-attn's paged layout `[num_blocks, page_block_size, nheads_k, headdim]` in each half, so
the kernels read our blocks in place through `block_table`. Per layer and step, after the
step's k/v rows went into the cache at `slot_mapping` (Triton's store kernel, `store_kv`, or
the rotary kernel in its pass, `layers.fused.qk_norm_rope_store_kv`):
  1. decode sequences (one query token each) go through `flash_attn_with_kvcache`, which picks
     a split-KV count for short batches of long contexts;
  2. the other sequences go through `flash_attn_varlen_func` over the paged cache. flash-attn
     aligns the causal mask to the bottom right when a sequence has fewer queries than keys,
     which is exactly where a chunk's queries sit after its cached prefix.
A layer's sliding window W is flash-attn's `window_size=(W - 1, 0)`: W - 1 keys to the left
of each query, as HF masks it.

flash-attn's own checks (flash_api.cpp) set what it can serve: fp16/bf16 only, head dims up
to 256, pages a multiple of 256 tokens. `flash_attn_unsupported_reason` mirrors them so the
selector falls back to Triton instead of failing on the first forward.

Nothing here reads device data on the host, so decode steps are captured in CUDA graphs; padded
graph rows have `seq_lens == 0` and slot -1 (not stored), and their output is not used.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minivllm.worker.attention.metadata import AttentionMetadata
from minivllm.worker.attention.triton_attention import store_kv_cache

_PAGE_MULTIPLE = 256  # "Paged KV cache block size must be divisible by 256"
_MAX_HEAD_DIM = 256
_HEAD_DIM_MULTIPLE = 8  # smaller multiples make flash-attn pad a copy of the whole cache
_DTYPES = (torch.float16, torch.bfloat16)


def flash_attn_unsupported_reason(block_size: int, head_dim: int, dtype: torch.dtype) -> str | None:
    """Why flash-attn cannot run this configuration (not importable, or outside its kernels'
    limits), or None when it can."""
    try:
        import flash_attn  # noqa: F401
    except ModuleNotFoundError as e:
        if e.name == "flash_attn":
            return "flash-attn not installed"
        return f"flash-attn does not import: {e}"
    except ImportError as e:  # e.g. a wheel built for another torch or CUDA
        return f"flash-attn does not import: {e}"
    if block_size % _PAGE_MULTIPLE:
        return f"block_size {block_size} is not a multiple of flash-attn's {_PAGE_MULTIPLE}-token pages"
    if head_dim % _HEAD_DIM_MULTIPLE or head_dim > _MAX_HEAD_DIM:
        return (
            f"head_dim {head_dim} is outside flash-attn's range "
            f"(multiples of {_HEAD_DIM_MULTIPLE} up to {_MAX_HEAD_DIM})"
        )
    if dtype not in _DTYPES:
        return f"flash-attn runs float16 or bfloat16, not {dtype}"
    return None


class FlashAttentionBackend:
    """Implements `AttentionBackend` (see metadata.py for the batch layout) with flash-attn."""

    store_kv = staticmethod(store_kv_cache)

    def __init__(self) -> None:
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

        self._varlen = flash_attn_varlen_func
        self._with_kvcache = flash_attn_with_kvcache

    def forward(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        kv_scale: torch.Tensor | None = None,  # 16-bit caches only: no scales
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        window = {} if sliding_window is None else {"window_size": (sliding_window - 1, 0)}
        nd, n, num_tokens = meta.num_decodes, meta.num_seqs, meta.num_tokens
        out = torch.empty_like(q)
        out[num_tokens:] = 0  # padding rows, as the torch reference leaves them
        if nd:
            decoded = self._with_kvcache(
                q[:nd].unsqueeze(1),
                k_cache,
                v_cache,
                cache_seqlens=meta.seq_lens[:nd],
                block_table=meta.block_table[:nd],
                softmax_scale=scale,
                causal=True,
                **window,
            )
            out[:nd] = decoded.squeeze(1)
        if n > nd:
            # decodes hold one query row each, so the other sequences' rows start at row nd;
            # offsets are built on the device, so nothing here waits for the GPU
            cu_seqlens_q = meta.query_start_loc[nd : n + 1] - nd
            cu_seqlens_k = F.pad(torch.cumsum(meta.seq_lens[nd:n], 0, dtype=torch.int32), (1, 0))
            out[nd:num_tokens] = self._varlen(
                q[nd:num_tokens],
                k_cache,
                v_cache,
                cu_seqlens_q,
                cu_seqlens_k,
                meta.max_query_len,
                meta.max_seq_len,
                softmax_scale=scale,
                causal=True,
                block_table=meta.block_table[nd:n],
                **window,
            )
        return out
