"""Triton paged attention: KV store, decode (optionally split-KV or cascade) and prefill.

Per layer and step, `store_kv_cache` (ops/kv_cache.py, the backend's `store_kv`) writes
this step's k/v rows into the paged cache at `slot_mapping` (unless the rotary kernel does
it in its own pass, `layers.fused.qk_norm_rope_store_kv`); then `forward` launches:
  1. `_decode_kernel` for sequences 0..num_decodes-1 (one query token each): one program per
     (sequence, kv head, split); the GQA q heads of a kv head form one `tl.dot` tile (rows
     padded to 16). With several splits each program covers a slice of the key tiles and
     `_merge_kernel` combines the slices by their log-sum-exp. Programs run longest
     context first when `meta.decode_order` is given (1.7% less attention time over the
     reference workload on an H100, whose contexts range from 100 to 2,048 tokens). With
     `meta.cascade_prefix_len`, each program reads only its sequence's keys past the shared
     prefix and `_cascade_prefix_kernel` (cascade.py) attends the prefix once for all rows.
  2. `_prefill_kernel` for the other sequences: tiles of queries x keys, causal, over the
     cached prefix plus this step's tokens (all read back from the cache, so chunked prefill
     and prefix-cache hits need nothing special).

A layer with a sliding window W (`WINDOW`, a compile-time constant: 0 for none) reads only
the keys its queries see: a decode program starts at key seq_len - W, a prefill tile at the
first key of its first row's window, and masks each row's keys below its own window. Such a
layer never reads the blocks behind its window, which the engine-core may have freed. It
attends its window with the plain decode kernel in a cascade step (the shared prefix is of
no use to it).

CUDA graphs: decode grids depend only on Python ints that are fixed per padded batch size
(`meta.num_decodes`, the number of kv heads); each program reads its real context length from
`seq_lens` on the device. Padded decode rows must have `seq_lens == 0` (their output is 0) and
padded tokens `slot_mapping == -1`. The split-KV scratch is allocated inside `forward`, which
is legal during capture (it comes from the graph's memory pool).

An FP8 cache (ops/kv_cache.py) is dequantized in registers: keys and values are converted to
the query's dtype as they are loaded, the key scale is folded into the softmax scale and the
value scale into the final normalisation. The conversions take registers: the decode kernel
over FP8 keys of 128 dims needs 202 a thread and fits two programs per SM, latency-bound.
Capped at `FP8_DECODE_MAXNREG` (three programs per SM, as shared memory allows) it took 126
µs instead of 143 for 256 sequences of ~600 tokens on an H200 (bf16: 165 µs); a cap of 128
with fewer stages or smaller tiles, or eight warps, were slower.
"""

from __future__ import annotations

import math

import torch

from minivllm.worker.attention.cascade import _cascade_prefix_kernel, num_prefix_splits
from minivllm.worker.attention.metadata import AttentionMetadata
from minivllm.worker.attention.tiles import MIN_PROGRAMS, attend_tile, store_part
from minivllm.worker.ops._triton import next_power_of_2, pdl, tl, triton, wait_for_producers
from minivllm.worker.ops.kv_cache import FP8, kv_scale_arg, load_kv_scales, store_kv_cache

LOG2E = 1.4426950408889634
FP8_DECODE_MAXNREG = 168  # registers a thread of the FP8 decode kernel (head_dim <= 128)


@triton.jit(do_not_specialize=["stride_bt"])
def _decode_kernel(
    q_ptr, cache_ptr, block_table_ptr, seq_lens_ptr, order_ptr, out_ptr, part_out_ptr,
    part_lse_ptr, kv_scale_ptr, prefix_ptr, scale_log2,
    stride_q_tok, stride_q_head, stride_o_tok, stride_o_head, stride_bt,
    stride_c_kv, stride_c_blk, stride_c_pos, stride_c_head,
    GQA: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr, NUM_SPLITS: tl.constexpr, NUM_PARTS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr, HAS_ORDER: tl.constexpr, CASCADE: tl.constexpr,
    FP8: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr, WINDOW: tl.constexpr = 0,
    PDL: tl.constexpr = False,
):  # fmt: skip
    wait_for_producers(PDL)
    # one flat grid, (rank, kv head, split) with the split fastest: programs are dispatched
    # in this order, so with `order` (longest context first) the longest work starts first
    pid = tl.program_id(0)
    split = pid % NUM_SPLITS
    kv_head = (pid // NUM_SPLITS) % NUM_KV_HEADS
    rank = pid // (NUM_SPLITS * NUM_KV_HEADS)
    if HAS_ORDER:
        seq = tl.load(order_ptr + rank)
    else:
        seq = rank
    seq_len = tl.load(seq_lens_ptr + seq)
    # cascade: the shared prefix [0, start) is attended by `_cascade_prefix_kernel` instead
    start = tl.load(prefix_ptr) if CASCADE else 0
    if WINDOW:  # the query at seq_len - 1 sees the keys from seq_len - WINDOW on
        start = tl.maximum(seq_len - WINDOW, 0)
    num_tiles = tl.cdiv(tl.maximum(seq_len - start, 0), BLOCK_N)
    tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    tile_start = split * tiles_per_split
    tile_end = tl.minimum(tile_start + tiles_per_split, num_tiles)
    k_scale, v_scale = load_kv_scales(kv_scale_ptr, FP8)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, HEAD_DIM)
    heads = kv_head * GQA + offs_g
    g_mask = offs_g < GQA
    # decode sequences come first with one token each: sequence i is query row i
    q = tl.load(
        q_ptr + seq * stride_q_tok + heads[:, None] * stride_q_head + offs_d[None, :],
        mask=g_mask[:, None],
        other=0.0,
    ).to(DOT)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    cache_head = cache_ptr + kv_head * stride_c_head
    qk_scale = scale_log2 * k_scale  # the key scale of an FP8 cache, folded in
    for tile in range(tile_start, tile_end):
        offs_n = start + tile * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < seq_len
        block = tl.load(block_table_ptr + seq * stride_bt + offs_n // PAGE, mask=n_mask, other=0)
        block = block.to(tl.int64)  # offsets into a cache of > 2^31 elements
        kv_off = block[:, None] * stride_c_blk + (offs_n % PAGE)[:, None] * stride_c_pos
        kv_off += offs_d[None, :]
        m_i, l_i, acc = attend_tile(
            q, cache_head, kv_off, n_mask, n_mask[None, :], m_i, l_i, acc, qk_scale,
            stride_c_kv, DOT, PRECISION,
        )  # fmt: skip

    has_keys = l_i > 0  # false for an empty split or a padded row (seq_len 0)
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    if FP8:
        out *= v_scale
    if NUM_PARTS == 1:
        o_ptrs = out_ptr + seq * stride_o_tok + heads[:, None] * stride_o_head + offs_d[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None])
    else:
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        store_part(
            part_out_ptr, part_lse_ptr, seq, heads, split, out, lse, g_mask,
            NUM_KV_HEADS * GQA, NUM_PARTS, HEAD_DIM,
        )  # fmt: skip


@triton.jit
def _merge_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, stride_o_tok, stride_o_head,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    wait_for_producers(PDL)
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, HEAD_DIM)
    s_mask = offs_s < NUM_SPLITS
    rows = (seq * NUM_HEADS + head) * NUM_SPLITS + offs_s
    lse = tl.load(part_lse_ptr + rows, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))  # all -inf: weights 0, output 0
    parts = tl.load(
        part_out_ptr + rows[:, None] * HEAD_DIM + offs_d[None, :], mask=s_mask[:, None], other=0.0
    )
    w_sum = tl.sum(w, 0)
    out = tl.sum(parts * w[:, None], 0) / tl.where(w_sum > 0, w_sum, 1.0)
    tl.store(
        out_ptr + seq * stride_o_tok + head * stride_o_head + offs_d,
        out.to(out_ptr.dtype.element_ty),
    )


@triton.jit(do_not_specialize=["first_seq", "stride_bt"])
def _prefill_kernel(
    q_ptr, cache_ptr, block_table_ptr, seq_lens_ptr, query_start_ptr, out_ptr, kv_scale_ptr,
    first_seq, scale_log2,
    stride_q_tok, stride_q_head, stride_o_tok, stride_o_head, stride_bt,
    stride_c_kv, stride_c_blk, stride_c_pos, stride_c_head,
    GQA: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr, FP8: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr,
    WINDOW: tl.constexpr = 0, PDL: tl.constexpr = False,
):  # fmt: skip
    wait_for_producers(PDL)
    seq = first_seq + tl.program_id(0)
    # the last query tiles see the most keys (causal): dispatch them first
    m_start = (tl.num_programs(1) - 1 - tl.program_id(1)) * BLOCK_M
    head = tl.program_id(2)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    if m_start >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix_len = seq_len - q_len  # tokens already in the cache before this step

    offs_m = m_start + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    m_mask = offs_m < q_len
    q_rows = (q_start + offs_m)[:, None]
    q = tl.load(
        q_ptr + q_rows * stride_q_tok + head * stride_q_head + offs_d[None, :],
        mask=m_mask[:, None],
        other=0.0,
    ).to(DOT)
    q_pos = prefix_len + offs_m  # position of each query row in its sequence
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    cache_head = cache_ptr + (head // GQA) * stride_c_head
    k_scale, v_scale = load_kv_scales(kv_scale_ptr, FP8)
    qk_scale = scale_log2 * k_scale  # the key scale of an FP8 cache, folded in
    kv_end = tl.minimum(seq_len, prefix_len + m_start + BLOCK_M)  # causal: later keys unused
    kv_start = 0
    if WINDOW:  # the first row's window starts here; row r's r keys later, in the same tile
        kv_start = tl.maximum(prefix_len + m_start - WINDOW + 1, 0)
    for n_start in range(kv_start, kv_end, BLOCK_N):
        offs_n = n_start + tl.arange(0, BLOCK_N)
        n_mask = offs_n < kv_end
        block = tl.load(block_table_ptr + seq * stride_bt + offs_n // PAGE, mask=n_mask, other=0)
        block = block.to(tl.int64)  # offsets into a cache of > 2^31 elements
        kv_off = block[:, None] * stride_c_blk + (offs_n % PAGE)[:, None] * stride_c_pos
        kv_off += offs_d[None, :]
        # every row sees a key of the first tile (key 0, or under a window the first of its
        # own, BLOCK_M <= BLOCK_N), so the row max is finite after the first tile
        visible = n_mask[None, :] & (offs_n[None, :] <= q_pos[:, None])
        if WINDOW:
            visible = visible & (offs_n[None, :] > q_pos[:, None] - WINDOW)
        m_i, l_i, acc = attend_tile(
            q, cache_head, kv_off, n_mask, visible, m_i, l_i, acc, qk_scale, stride_c_kv,
            DOT, PRECISION,
        )  # fmt: skip

    out = acc / l_i[:, None]
    if FP8:
        out *= v_scale
    o_ptrs = out_ptr + q_rows * stride_o_tok + head * stride_o_head + offs_d[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None])


def num_decode_splits(num_decodes: int, num_kv_heads: int) -> int:
    """Key-range splits per decode (sequence, kv head): enough programs to fill an H100
    (MIN_PROGRAMS), at most 16.

    Depends only on the padded batch size and the model, so a captured graph keeps it. A
    power of two, so only five kernel variants exist and all are compiled while the decode
    graphs are captured, never in the middle of a run.
    """
    work = num_decodes * num_kv_heads
    if work >= MIN_PROGRAMS:
        return 1
    wanted = max(1, min(16, -(-2 * MIN_PROGRAMS // work)))
    return 1 << (wanted.bit_length() - 1)


class TritonAttentionBackend:
    """Paged attention on the GPU (or on CPU tensors under TRITON_INTERPRET=1).

    Knobs for benchmarks: `num_splits` forces the decode split count (by default
    `num_decode_splits`); `decode_block_n`, `decode_stages`, `decode_warps` and
    `decode_maxnreg` the decode kernel's key tile, pipeline depth, warps and register cap
    (0: none); `fp8_dot_f16=False` keeps an FP8 cache's dots in bfloat16 for a
    bfloat16 model.

    Dense prefill through torch's FlashAttention-2 `varlen_attn` was measured against the
    paged prefill kernel on an H100 (14 prompts, 7,625 tokens, Qwen3-0.6B heads): 249 µs per
    layer against 186 µs, and slower still end to end, so prompts stay on the paged kernel.
    """

    store_kv = staticmethod(store_kv_cache)

    def __init__(
        self,
        num_splits: int | None = None,
        decode_block_n: int | None = None,
        decode_stages: int | None = None,
        fp8_dot_f16: bool = True,
        decode_warps: int | None = None,
        decode_maxnreg: int | None = None,
    ) -> None:
        self.num_splits = num_splits
        self.decode_block_n = decode_block_n
        self.decode_stages = decode_stages
        self.decode_warps = decode_warps
        self.decode_maxnreg = decode_maxnreg
        self.fp8_dot_f16 = fp8_dot_f16

    def forward(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        kv_scale: torch.Tensor | None = None,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        num_heads, head_dim = q.shape[1], q.shape[2]
        num_kv_heads = kv_cache.shape[3]
        if head_dim < 16 or head_dim & (head_dim - 1):
            raise ValueError(f"head_dim must be a power of two >= 16, got {head_dim}")
        if num_heads % num_kv_heads:
            raise ValueError(f"{num_heads} q heads do not divide into {num_kv_heads} kv heads")
        assert q.stride(2) == kv_cache.stride(4) == 1
        fp8 = kv_cache.dtype == FP8

        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        common = dict(
            GQA=num_heads // num_kv_heads, HEAD_DIM=head_dim, PAGE=meta.block_size, FP8=fp8,
            DOT=self._dot_dtype(q.dtype, fp8),
            PRECISION="ieee" if q.dtype == torch.float32 else "tf32", **pdl(q),
        )  # fmt: skip
        window = sliding_window or 0
        scale_log2, scales = scale * LOG2E, kv_scale_arg(kv_scale, fp8, q)
        if meta.num_decodes:
            cascade = meta.cascade_prefix_len is not None and not window
            self._decode(q, out, kv_cache, meta, scale_log2, scales, common, cascade, window)
        num_prefills = meta.num_seqs - meta.num_decodes
        if num_prefills:
            # 16-bit tiles fit twice as many keys in shared memory
            wide = q.dtype != torch.float32
            # block_m <= block_n: under a window each row sees a key of its first tile
            block_m, block_n, warps, stages = (64, 64, 4, 2) if wide else (32, 32, 4, 2)
            _prefill_kernel[(num_prefills, math.ceil(meta.max_query_len / block_m), num_heads)](
                q, kv_cache, meta.block_table, meta.seq_lens, meta.query_start_loc, out,
                scales, meta.num_decodes, scale_log2, q.stride(0), q.stride(1),
                out.stride(0), out.stride(1), meta.block_table.stride(0), *kv_cache.stride()[:4],
                BLOCK_M=block_m, BLOCK_N=block_n, WINDOW=window, num_warps=warps,
                num_stages=stages, **common,
            )  # fmt: skip
        return out

    def _dot_dtype(self, q_dtype: torch.dtype, fp8: bool) -> object:
        """The dtype the kernels' dots take: the query's, except that with an FP8 cache the
        16-bit dots run in float16, to which e4m3 converts in one instruction per pair (to
        bfloat16 in three); queries are far inside float16's range."""
        if fp8 and q_dtype != torch.float32 and self.fp8_dot_f16:
            return tl.float16
        return {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16}.get(q_dtype, tl.float16)

    def _decode(
        self,
        q: torch.Tensor,
        out: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale_log2: float,
        kv_scale: torch.Tensor,
        common: dict,
        cascade: bool,
        window: int,
    ) -> None:
        """Decode rows 0..num_decodes-1: split-KV or cascade partials, then their merge; a
        windowed layer (`window` > 0) reads only the last `window` keys of each row."""
        nd, num_heads, head_dim = meta.num_decodes, q.shape[1], q.shape[2]
        num_kv_heads = kv_cache.shape[3]
        wide = q.dtype != torch.float32
        if cascade:  # each sequence's own keys in one piece: they are few
            splits = 1
            prefix_m, prefix_n = (64, 64) if wide else (32, 32)
            prefix_tiles = -(-nd * common["GQA"] // prefix_m)
            prefix_splits = num_prefix_splits(prefix_tiles, num_kv_heads)
        else:
            splits = self.num_splits or num_decode_splits(nd, num_kv_heads)
            prefix_splits = 0
        num_parts = splits + prefix_splits
        part_out = part_lse = out  # unused without splits
        if num_parts > 1:
            part_out = torch.empty(
                (nd, num_heads, num_parts, head_dim), dtype=torch.float32, device=q.device
            )
            part_lse = torch.empty((nd, num_heads, num_parts), dtype=torch.float32, device=q.device)
        order = meta.decode_order
        prefix_len = meta.cascade_prefix_len if cascade else meta.seq_lens
        cache_strides = kv_cache.stride()[:4]
        block_n = self.decode_block_n or (128 if wide and head_dim <= 128 else 64)
        gqa = common["GQA"]
        maxnreg = self.decode_maxnreg
        if maxnreg is None and common["FP8"] and wide and head_dim <= 128 and block_n == 128:
            maxnreg = FP8_DECODE_MAXNREG
        cap = {"maxnreg": maxnreg} if maxnreg else {}
        _decode_kernel[(nd * num_kv_heads * splits,)](
            q, kv_cache, meta.block_table, meta.seq_lens,
            meta.seq_lens if order is None else order, out, part_out, part_lse, kv_scale,
            prefix_len, scale_log2, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            meta.block_table.stride(0), *cache_strides,
            BLOCK_G=max(16, next_power_of_2(gqa)), BLOCK_N=block_n, NUM_SPLITS=splits,
            NUM_PARTS=num_parts, NUM_KV_HEADS=num_kv_heads, HAS_ORDER=order is not None,
            CASCADE=cascade, WINDOW=window, num_warps=self.decode_warps or 4,
            num_stages=self.decode_stages or (3 if wide else 2), **common, **cap,
        )  # fmt: skip
        if cascade:
            _cascade_prefix_kernel[(num_kv_heads, prefix_tiles, prefix_splits)](
                q, kv_cache, meta.block_table, meta.seq_lens, prefix_len, kv_scale, part_out,
                part_lse, nd, scale_log2, q.stride(0), q.stride(1), meta.block_table.stride(0),
                *cache_strides, BLOCK_M=prefix_m, BLOCK_N=prefix_n, NUM_SPLITS=prefix_splits,
                FIRST_PART=splits, NUM_PARTS=num_parts, NUM_KV_HEADS=num_kv_heads,
                num_warps=4, num_stages=2, **common,
            )  # fmt: skip
        if num_parts > 1:
            _merge_kernel[(nd, num_heads)](
                part_out, part_lse, out, out.stride(0), out.stride(1),
                NUM_HEADS=num_heads, HEAD_DIM=head_dim, NUM_SPLITS=num_parts,
                BLOCK_S=next_power_of_2(num_parts), **pdl(q),
            )  # fmt: skip
