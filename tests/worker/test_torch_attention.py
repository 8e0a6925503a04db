"""The torch reference backend against dense causal attention over whole sequences."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from minivllm.worker.attention.layer import PagedAttention, forward_batch
from minivllm.worker.attention.metadata import AttentionMetadata
from minivllm.worker.attention.torch_attention import TorchAttentionBackend
from tests.attention_step import attend

BLOCK_SIZE = 4
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 4, 2, 8
SCALE = HEAD_DIM**-0.5


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [q_len, H, D] are the last q_len positions of k, v [L, Hkv, D]."""
    q_len, seq_len = q.shape[0], k.shape[0]
    rep = NUM_HEADS // NUM_KV_HEADS
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    mask = torch.ones(q_len, seq_len, dtype=torch.bool).tril(diagonal=seq_len - q_len)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=SCALE
    )
    return out.transpose(0, 1)


def make_meta(blocks, cached, q_lens, pad_rows=0, skip_tokens=()) -> AttentionMetadata:
    slots, starts, seq_lens = [], [0], []
    for blk, c, n in zip(blocks, cached, q_lens, strict=True):
        slots += [blk[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(c, c + n)]
        starts.append(starts[-1] + n)
        seq_lens.append(c + n)
    for t in skip_tokens:
        slots[t] = -1
    width = max(map(len, blocks))
    n = starts[-1]
    return AttentionMetadata(
        num_tokens=n,
        num_seqs=len(blocks),
        num_decodes=sum(1 for q in q_lens if q == 1),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=torch.tensor([b + [0] * (width - len(b)) for b in blocks], dtype=torch.int32),
        slot_mapping=torch.tensor(slots + [-1] * pad_rows, dtype=torch.int64),
        block_size=BLOCK_SIZE,
    )


def rand(n: int, heads: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(n, heads, HEAD_DIM, generator=gen)


def test_paged_attention_matches_dense_over_two_steps() -> None:
    gen = torch.Generator().manual_seed(0)
    blocks = [[5, 1, 9], [0, 7], [3, 8, 2, 6]]
    total = [10, 6, 13]  # tokens per sequence over both steps
    first = [9, 5, 7]  # step 1: whole prompt, prompt minus one, first chunk
    ks = [rand(n, NUM_KV_HEADS, gen) for n in total]
    vs = [rand(n, NUM_KV_HEADS, gen) for n in total]
    qs = [rand(n, NUM_HEADS, gen) for n in total]
    kv_cache = torch.zeros(2, 10, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    backend = TorchAttentionBackend()

    def step(seq_ids, cached, q_lens, pad_rows=0):
        meta = make_meta([blocks[i] for i in seq_ids], cached, q_lens, pad_rows)
        pick = [(i, c, c + n) for i, c, n in zip(seq_ids, cached, q_lens, strict=True)]
        pad = torch.zeros(pad_rows, NUM_HEADS, HEAD_DIM)
        pad_kv = torch.zeros(pad_rows, NUM_KV_HEADS, HEAD_DIM)
        q = torch.cat([qs[i][a:b] for i, a, b in pick] + [pad])
        k = torch.cat([ks[i][a:b] for i, a, b in pick] + [pad_kv])
        v = torch.cat([vs[i][a:b] for i, a, b in pick] + [pad_kv])
        out = attend(backend, q, k, v, kv_cache, meta, SCALE)
        assert out.shape == q.shape
        expected = torch.cat(
            [dense_attention(qs[i][a:b], ks[i][:b], vs[i][:b]) for i, a, b in pick]
        )
        torch.testing.assert_close(out[: meta.num_tokens], expected, atol=1e-5, rtol=1e-5)
        assert not out[meta.num_tokens :].any()

    step([0, 1, 2], [0, 0, 0], first)
    # decodes first (sequences 1 and 0), then the second chunk of sequence 2; plus padding rows
    step([1, 0, 2], [5, 9, 7], [1, 1, 6], pad_rows=3)


def test_host_copies_are_used_when_present() -> None:
    gen = torch.Generator().manual_seed(1)
    meta = make_meta([[2, 0]], [0], [6])
    meta.query_start_loc_cpu = meta.query_start_loc.clone()
    meta.seq_lens_cpu = meta.seq_lens.clone()
    meta.query_start_loc = meta.seq_lens = None  # must not be touched
    q, k, v = rand(6, NUM_HEADS, gen), rand(6, NUM_KV_HEADS, gen), rand(6, NUM_KV_HEADS, gen)
    kv_cache = torch.zeros(2, 3, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    out = attend(TorchAttentionBackend(), q, k, v, kv_cache, meta, SCALE)
    torch.testing.assert_close(out, dense_attention(q, k, v), atol=1e-5, rtol=1e-5)


def test_negative_slots_are_not_stored() -> None:
    gen = torch.Generator().manual_seed(2)
    meta = make_meta([[1, 0]], [0], [5], skip_tokens=(2,))
    q, k, v = rand(5, NUM_HEADS, gen), rand(5, NUM_KV_HEADS, gen), rand(5, NUM_KV_HEADS, gen)
    kv_cache = torch.zeros(2, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    attend(TorchAttentionBackend(), q, k, v, kv_cache, meta, SCALE)
    keys = kv_cache[0, [1, 0]].reshape(-1, NUM_KV_HEADS, HEAD_DIM)
    torch.testing.assert_close(keys[[0, 1, 3, 4]], k[[0, 1, 3, 4]])
    assert not keys[2].any()


def test_bf16_cache_and_inputs() -> None:
    gen = torch.Generator().manual_seed(3)
    meta = make_meta([[0, 1, 2]], [0], [10])
    q, k, v = (t.bfloat16() for t in (rand(10, NUM_HEADS, gen), rand(10, 2, gen), rand(10, 2, gen)))
    kv_cache = torch.zeros(2, 3, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype=torch.bfloat16)
    out = attend(TorchAttentionBackend(), q, k, v, kv_cache, meta, SCALE)
    assert out.dtype == torch.bfloat16
    expected = dense_attention(q.float(), k.float(), v.float())
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


def test_attention_reads_the_one_forward_batch_in_scope() -> None:
    gen = torch.Generator().manual_seed(4)
    meta = make_meta([[0, 1]], [0], [6])
    q, k, v = rand(6, NUM_HEADS, gen), rand(6, NUM_KV_HEADS, gen), rand(6, NUM_KV_HEADS, gen)
    layer = PagedAttention(0, TorchAttentionBackend(), SCALE)
    with pytest.raises(RuntimeError, match="outside a forward batch"):
        layer.store_kv(k, v)
    kv_cache = torch.zeros(2, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    with forward_batch(meta, [kv_cache]):
        with pytest.raises(RuntimeError, match="do not nest"), forward_batch(meta, [kv_cache]):
            pass
        layer.store_kv(k, v)
        torch.testing.assert_close(layer(q), dense_attention(q, k, v), atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="outside a forward batch"):  # the scope has ended
        layer(q)
