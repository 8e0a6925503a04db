"""The batched CPU backend computes what the torch reference computes."""

from __future__ import annotations

import pytest
import torch

from minivllm.worker.attention.cpu_attention import CpuAttentionBackend
from minivllm.worker.attention.metadata import AttentionMetadata
from minivllm.worker.attention.torch_attention import TorchAttentionBackend
from tests.attention_step import attend


def _batch(q_lens: list[int], ctx_lens: list[int], block_size: int, num_blocks: int, gen):
    """Metadata for sequences with q_lens new tokens on top of ctx_lens cached ones,
    their blocks scattered over the cache."""
    perm = torch.randperm(num_blocks, generator=gen)
    seq_lens = [c + q for c, q in zip(ctx_lens, q_lens, strict=True)]
    max_blocks = max(-(-s // block_size) for s in seq_lens)
    table = torch.zeros(len(q_lens), max_blocks, dtype=torch.int32)
    used = 0
    slots = []
    for i, (q, s) in enumerate(zip(q_lens, seq_lens, strict=True)):
        nb = -(-s // block_size)
        table[i, :nb] = perm[used : used + nb]
        used += nb
        for pos in range(s - q, s):
            slots.append(int(table[i, pos // block_size]) * block_size + pos % block_size)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return AttentionMetadata(
        num_tokens=sum(q_lens),
        num_seqs=len(q_lens),
        num_decodes=sum(1 for q in q_lens if q == 1),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        query_start_loc=starts,
        seq_lens=lens,
        block_table=table,
        slot_mapping=torch.tensor(slots, dtype=torch.long),
        block_size=block_size,
        query_start_loc_cpu=starts,
        seq_lens_cpu=lens,
    )


@pytest.mark.parametrize("group", [1, 2, 4])
def test_matches_reference(group: int) -> None:
    gen = torch.Generator().manual_seed(group)
    kv_heads, head_dim, block_size, num_blocks = 2, 16, 4, 64
    # decodes first (one query token), then a fresh prefill and a chunk over a cached prefix
    q_lens, ctx = [1, 1, 1, 9, 5], [7, 0, 30, 0, 12]
    meta = _batch(q_lens, ctx, block_size, num_blocks, gen)
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen)
    n = meta.num_tokens
    q = torch.randn(n, kv_heads * group, head_dim, generator=gen)
    k = torch.randn(n, kv_heads, head_dim, generator=gen)
    v = torch.randn(n, kv_heads, head_dim, generator=gen)
    ref_cache, fast_cache = cache.clone(), cache.clone()
    ref = attend(TorchAttentionBackend(), q, k, v, ref_cache, meta, 0.25)
    fast = attend(CpuAttentionBackend(), q, k, v, fast_cache, meta, 0.25)
    torch.testing.assert_close(fast, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fast_cache, ref_cache)


@pytest.mark.parametrize(("group", "window"), [(1, 3), (2, 8), (4, 13), (2, 100)])
def test_sliding_window_matches_dense_and_reads_nothing_behind_it(group: int, window: int) -> None:
    """Both backends against dense attention with the window's mask, the block-table entries
    wholly behind each window pointing at a block of NaNs (blocks the engine freed)."""
    gen = torch.Generator().manual_seed(10 + window)
    kv_heads, head_dim, block_size, num_blocks = 2, 16, 4, 80
    q_lens, ctx = [1, 1, 1, 1, 9, 5, 30], [7, 0, 30, 61, 0, 12, 20]
    meta = _batch(q_lens, ctx, block_size, num_blocks - 1, gen)  # block 79: never held
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen)
    n = meta.num_tokens
    q = torch.randn(n, kv_heads * group, head_dim, generator=gen)
    k = torch.randn(n, kv_heads, head_dim, generator=gen)
    v = torch.randn(n, kv_heads, head_dim, generator=gen)
    TorchAttentionBackend.store_kv(k, v, cache, meta.slot_mapping)
    expected = []
    for i, (q_len, c) in enumerate(zip(q_lens, ctx, strict=True)):
        rows = meta.block_table[i, : -(-(c + q_len) // block_size)].long()
        keys, values = (cache[j, rows].flatten(0, 1)[: c + q_len] for j in (0, 1))
        query_pos = torch.arange(c, c + q_len)[:, None]
        key_pos = torch.arange(c + q_len)[None, :]
        mask = (key_pos <= query_pos) & (key_pos > query_pos - window)
        start = int(meta.query_start_loc[i])
        o = torch.nn.functional.scaled_dot_product_attention(
            q[start : start + q_len].transpose(0, 1),
            keys.transpose(0, 1),
            values.transpose(0, 1),
            attn_mask=mask,
            scale=0.25,
            enable_gqa=True,
        )
        expected.append(o.transpose(0, 1))
        meta.block_table[i, : max(0, c - window + 1) // block_size] = num_blocks - 1
    cache[:, num_blocks - 1] = float("nan")
    for backend in (TorchAttentionBackend(), CpuAttentionBackend()):
        out = attend(backend, q, k, v, cache.clone(), meta, 0.25, sliding_window=window)
        torch.testing.assert_close(out, torch.cat(expected), atol=1e-5, rtol=1e-5)
