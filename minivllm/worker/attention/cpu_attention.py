"""Attention for the CPU path: all decode sequences in one batched gather + two matmuls,
prefill sequences through `scaled_dot_product_attention`.

The torch reference loops over every sequence in Python, which dominates a CPU decode step
at a few hundred sequences; this backend does the same math in a handful of ops. Under a
sliding window each sequence's keys are gathered from the first block its window reaches.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minivllm.worker.attention.metadata import AttentionMetadata
from minivllm.worker.attention.torch_attention import first_block, kv_scales, store_kv
from minivllm.worker.ops.kv_cache import dequantize

# bound on the gathered K (or V) elements per decode chunk, so memory stays flat
_MAX_GATHER_ELEMENTS = 1 << 25


class CpuAttentionBackend:
    """Implements `AttentionBackend` (see metadata.py for the batch layout)."""

    store_kv = staticmethod(store_kv)

    def forward(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        kv_scale: torch.Tensor | None = None,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        scales = kv_scales(kv_scale, kv_cache)
        out = torch.zeros_like(q)
        seq_lens = meta.seq_lens_cpu if meta.seq_lens_cpu is not None else meta.seq_lens.cpu()
        starts = meta.query_start_loc_cpu
        if starts is None:
            starts = meta.query_start_loc.cpu()
        d = meta.num_decodes
        if d:
            out[:d] = _decode(
                q[:d], kv_cache, scales, meta.block_table[:d], seq_lens[:d], scale, sliding_window
            )
        starts_list, lens_list = starts.tolist(), seq_lens.tolist()
        for i in range(d, meta.num_seqs):
            q_start, q_end, seq_len = starts_list[i], starts_list[i + 1], lens_list[i]
            out[q_start:q_end] = _prefill(
                q[q_start:q_end], kv_cache, scales, meta.block_table[i], seq_len, scale,
                sliding_window,
            )  # fmt: skip
        return out


def _decode(
    q: torch.Tensor,  # [d, num_heads, head_dim]
    kv_cache: torch.Tensor,
    scales: tuple[torch.Tensor, torch.Tensor],
    block_table: torch.Tensor,  # [d, max_blocks]
    seq_lens: torch.Tensor,  # [d] on the host
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    d, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    group = num_heads // num_kv_heads
    if sliding_window is None:
        first = None
        num_blocks = -(-int(seq_lens.max()) // block_size)
    else:  # each row's blocks from the one its window starts in
        first = ((seq_lens - sliding_window).clamp(min=0) // block_size).long()
        num_blocks = int(((seq_lens - 1).clamp(min=0) // block_size - first).max()) + 1
    per_seq = num_blocks * block_size * num_kv_heads * head_dim
    chunk = max(1, _MAX_GATHER_ELEMENTS // per_seq)
    out = torch.empty_like(q)
    positions = torch.arange(num_blocks * block_size)
    for s in range(0, d, chunk):
        e = min(d, s + chunk)
        lens = seq_lens[s:e, None]
        if first is None:
            blocks = block_table[s:e, :num_blocks].long()
            valid = positions[None, :] < lens  # [b, L]
        else:
            index = first[s:e, None] + torch.arange(num_blocks)
            index = index.clamp(max=block_table.shape[1] - 1)  # past the table: masked below
            blocks = block_table[s:e].long().gather(1, index)
            key_pos = first[s:e, None] * block_size + positions[None, :]
            valid = (key_pos < lens) & (key_pos >= lens - sliding_window)
        keys = kv_cache[0][blocks].flatten(1, 2).transpose(1, 2)  # [b, kv_heads, L, head_dim]
        values = kv_cache[1][blocks].flatten(1, 2).transpose(1, 2)
        keys, values = dequantize(keys, scales[0], q.dtype), dequantize(values, scales[1], q.dtype)
        o = F.scaled_dot_product_attention(
            q[s:e, :, None, :],
            keys,
            values,
            attn_mask=valid[:, None, None, :],
            scale=scale,
            enable_gqa=group > 1,
        )
        out[s:e] = o[:, :, 0]
    return out


def _prefill(
    q: torch.Tensor,  # [q_len, num_heads, head_dim]
    kv_cache: torch.Tensor,
    scales: tuple[torch.Tensor, torch.Tensor],
    block_row: torch.Tensor,
    seq_len: int,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    q_len, num_heads, head_dim = q.shape
    num_kv_heads, block_size = kv_cache.shape[-2], kv_cache.shape[2]
    start = first_block(seq_len - q_len, sliding_window, block_size) * block_size
    blocks = block_row[start // block_size : -(-seq_len // block_size)].long()
    keys = kv_cache[0][blocks].flatten(0, 1)[: seq_len - start]  # [L, kv_heads, head_dim]
    values = kv_cache[1][blocks].flatten(0, 1)[: seq_len - start]
    keys, values = dequantize(keys, scales[0], q.dtype), dequantize(values, scales[1], q.dtype)
    gqa = num_heads != num_kv_heads
    qt, kt, vt = q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1)
    if q_len == seq_len and sliding_window is None:
        o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale, enable_gqa=gqa)
    else:  # the queries are the last q_len positions: a causal mask shifted by the prefix
        query_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
        key_pos = torch.arange(start, seq_len)[None, :]
        mask = key_pos <= query_pos
        if sliding_window is not None:
            mask &= key_pos > query_pos - sliding_window
        o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return o.transpose(0, 1)
