"""Reference attention backend in plain torch: slow, simple, and the numerics to trust.

It loops over sequences on the host, gathers each sequence's keys/values from its blocks
(under a sliding window, from the first block the window reaches) and runs dense causal
attention in float32. Works on any device; other backends are
tested against it.
"""

from __future__ import annotations

import torch

from minivllm.worker.attention.metadata import AttentionMetadata
from minivllm.worker.ops.kv_cache import FP8, dequantize, quantize


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    slots: torch.Tensor,
    kv_scale: torch.Tensor | None = None,
) -> None:
    """Write row t of k/v to flat cache slot slots[t] as the cache stores it (an FP8 cache:
    divided by `kv_scale`, ops/kv_cache.py); rows with a negative slot are skipped."""
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    n = len(slots)
    k_scale, v_scale = kv_scales(kv_scale, kv_cache)
    keep = slots >= 0
    k, v = k[:n], v[:n]
    if not bool(keep.all()):
        slots, k, v = slots[keep], k[keep], v[keep]
    k, v = quantize(k, k_scale, kv_cache.dtype), quantize(v, v_scale, kv_cache.dtype)
    if kv_cache.dtype == FP8:  # index_copy_ has no float8 kernel on the CPU: copy the bytes
        kv_cache, k, v = kv_cache.view(torch.uint8), k.view(torch.uint8), v.view(torch.uint8)
    kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slots, k)
    kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slots, v)


def kv_scales(
    kv_scale: torch.Tensor | None, kv_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(k_scale, v_scale) as scalar tensors; 1.0 for a 16-bit cache given none."""
    if kv_scale is None:
        if kv_cache.dtype == FP8:
            raise ValueError("an fp8 KV cache needs its kv_scale")
        kv_scale = torch.ones(2, device=kv_cache.device)
    return kv_scale[0], kv_scale[1]


class TorchAttentionBackend:
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
        num_kv_heads, head_dim = kv_cache.shape[-2:]
        k_scale, v_scale = kv_scales(kv_scale, kv_cache)
        starts = _host_list(meta.query_start_loc_cpu, meta.query_start_loc)
        seq_lens = _host_list(meta.seq_lens_cpu, meta.seq_lens)
        # rows past num_tokens are padding (e.g. for a captured graph): left as zeros
        out = torch.zeros_like(q)
        for i in range(meta.num_seqs):
            q_start, q_end, seq_len = starts[i], starts[i + 1], seq_lens[i]
            num_blocks = -(-seq_len // meta.block_size)
            first = first_block(seq_len - (q_end - q_start), sliding_window, meta.block_size)
            blocks = meta.block_table[i, first:num_blocks].long()
            n = seq_len - first * meta.block_size
            keys = kv_cache[0, blocks].reshape(-1, num_kv_heads, head_dim)[:n]
            values = kv_cache[1, blocks].reshape(-1, num_kv_heads, head_dim)[:n]
            keys = dequantize(keys, k_scale, torch.float32)
            values = dequantize(values, v_scale, torch.float32)
            o = causal_attention(q[q_start:q_end], keys, values, scale, sliding_window)
            out[q_start:q_end] = o.to(q.dtype)
        return out


def first_block(first_query: int, sliding_window: int | None, block_size: int) -> int:
    """The first block that a sequence's queries from position `first_query` on read: the
    one holding the first key of the first query's window (0 without a window)."""
    if sliding_window is None:
        return 0
    return max(0, first_query - sliding_window + 1) // block_size


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Dense attention of one sequence in float32, its queries being its last positions.

    q: [q_len, num_heads, head_dim]; k, v: [seq_len, num_kv_heads, head_dim] with
    seq_len >= q_len (under a window, k may start anywhere before the first query's window).
    Query head h reads kv head h // (num_heads // num_kv_heads), as in HF.
    """
    q_len, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    k = k.float().repeat_interleave(group, dim=1)
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    query_pos = torch.arange(seq_len - q_len, seq_len, device=q.device).unsqueeze(1)
    key_pos = torch.arange(seq_len, device=q.device).unsqueeze(0)
    hidden = key_pos > query_pos
    if sliding_window is not None:
        hidden |= key_pos <= query_pos - sliding_window
    scores = scores.masked_fill(hidden, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v)


def _host_list(host: torch.Tensor | None, device_tensor: torch.Tensor) -> list[int]:
    return (host if host is not None else device_tensor).tolist()
