"""Cascade attention: a decode batch whose sequences share a cached prefix reads it once.

When every decode sequence's block table starts with the same physical blocks (a shared
system prompt served from the prefix cache), the plain decode kernel reads those blocks once
per sequence. Here the shared prefix `[0, P)` is attended by all decode queries together,
`_cascade_prefix_kernel` computing one query tile of (sequence, q head) rows x the prefix's
key tiles with `tl.dot` -- the prefix is read once per kv head and step -- while the decode
kernel attends each sequence's own keys `[P, seq_len)`. Both write partial softmaxes
(normalized output and log2-sum-exp) into one scratch tensor, and the split-KV merge kernel
combines them: softmax over the union of the key ranges, exactly.

P comes from the KV cache manager (blocks held by every running request, found by their
reference counts) and lives on the device (`AttentionMetadata.cascade_prefix_len`), so a
CUDA graph captured with cascade on replays for any prefix length. `use_cascade` is the cost
rule that decides per step.
"""

from __future__ import annotations

from minivllm.worker.attention.tiles import MIN_PROGRAMS, attend_tile, store_part
from minivllm.worker.ops._triton import tl, triton, wait_for_producers
from minivllm.worker.ops.kv_cache import load_kv_scales

# the decode kernel reads each sequence's copy of the prefix: (num_decodes - 1) * P tokens of
# KV more than cascade; cascade pays two launches and a merge pass (~2-4 µs per layer on an
# H100, ~10 MB of KV at 3 TB/s). Below this many saved tokens per kv head it is not worth it.
MIN_SAVED_TOKENS = 8192
MIN_PREFIX_TOKENS = 256  # as vLLM's rule: a shorter shared prefix is not worth a kernel


def use_cascade(num_decodes: int, prefix_len: int) -> bool:
    """Whether attending a shared prefix of `prefix_len` tokens once for `num_decodes`
    sequences beats reading it once per sequence."""
    return prefix_len >= MIN_PREFIX_TOKENS and (num_decodes - 1) * prefix_len >= MIN_SAVED_TOKENS


def num_prefix_splits(num_tiles: int, num_kv_heads: int) -> int:
    """Key-range splits of the prefix per (kv head, query tile): enough programs to fill an
    H100 whatever the prefix length turns out to be at replay (a power of two, <= 16)."""
    work = num_tiles * num_kv_heads
    wanted = max(1, min(16, -(-MIN_PROGRAMS // work)))
    return 1 << (wanted.bit_length() - 1)


@triton.jit(do_not_specialize=["stride_bt"])
def _cascade_prefix_kernel(
    q_ptr, cache_ptr, block_table_ptr, seq_lens_ptr, prefix_ptr, kv_scale_ptr,
    part_out_ptr, part_lse_ptr, num_decodes, scale_log2,
    stride_q_tok, stride_q_head, stride_bt,
    stride_c_kv, stride_c_blk, stride_c_pos, stride_c_head,
    GQA: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr, NUM_SPLITS: tl.constexpr, FIRST_PART: tl.constexpr,
    NUM_PARTS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, FP8: tl.constexpr,
    DOT: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    wait_for_producers(PDL)
    kv_head = tl.program_id(0)
    split = tl.program_id(2)
    # row r of the tile: decode sequence r // GQA, q head kv_head * GQA + r % GQA
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    seq = rows // GQA
    heads = kv_head * GQA + rows % GQA
    seq_len = tl.load(seq_lens_ptr + seq, mask=seq < num_decodes, other=0)
    valid = seq_len > 0  # padded rows (seq_len 0) take no part
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(
        q_ptr + seq[:, None] * stride_q_tok + heads[:, None] * stride_q_head + offs_d[None, :],
        mask=valid[:, None],
        other=0.0,
    ).to(DOT)
    prefix_len = tl.load(prefix_ptr)
    num_tiles = tl.cdiv(prefix_len, BLOCK_N)
    tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    tile_start = split * tiles_per_split
    tile_end = tl.minimum(tile_start + tiles_per_split, num_tiles)
    k_scale, v_scale = load_kv_scales(kv_scale_ptr, FP8)
    qk_scale = scale_log2 * k_scale

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    cache_head = cache_ptr + kv_head * stride_c_head
    for tile in range(tile_start, tile_end):
        offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < prefix_len
        # the prefix blocks are the same in every row of the block table: read row 0's
        block = tl.load(block_table_ptr + offs_n // PAGE, mask=n_mask, other=0).to(tl.int64)
        kv_off = block[:, None] * stride_c_blk + (offs_n % PAGE)[:, None] * stride_c_pos
        kv_off += offs_d[None, :]
        m_i, l_i, acc = attend_tile(
            q, cache_head, kv_off, n_mask, n_mask[None, :], m_i, l_i, acc, qk_scale,
            stride_c_kv, DOT, PRECISION,
        )  # fmt: skip

    has_keys = valid & (l_i > 0)
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    if FP8:
        out *= v_scale
    lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
    store_part(
        part_out_ptr, part_lse_ptr, seq, heads, FIRST_PART + split, out, lse,
        seq < num_decodes, NUM_KV_HEADS * GQA, NUM_PARTS, HEAD_DIM,
    )  # fmt: skip
