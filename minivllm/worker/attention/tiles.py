"""The Triton pieces the attention kernels share (decode, cascade prefix, prefill)."""

from __future__ import annotations

from minivllm.worker.ops._triton import tl, triton

MIN_PROGRAMS = 256  # programs the split-KV grids aim for: enough to fill an H100


@triton.jit
def attend_tile(
    q, cache_head, kv_off, n_mask, visible, m_i, l_i, acc, qk_scale, stride_c_kv,
    DOT: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """One key tile of an online softmax: load the tile's keys at `cache_head + kv_off`
    (rows where `n_mask`), score the queries q against them (`visible` keeps a score), fold
    the scores into the running max `m_i` and sum `l_i`, then load the values and add their
    weighted sum into `acc`. Keys and values convert to `DOT` as they are loaded (an FP8
    cache's dequantization; its key scale is in `qk_scale`). Returns (m_i, l_i, acc)."""
    k = tl.load(cache_head + kv_off, mask=n_mask[:, None], other=0.0).to(DOT)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(cache_head + stride_c_kv + kv_off, mask=n_mask[:, None], other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(DOT), v.to(DOT), input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def store_part(
    part_out_ptr, part_lse_ptr, seq, heads, part, out, lse, mask,
    NUM_HEADS: tl.constexpr, NUM_PARTS: tl.constexpr, HEAD_DIM: tl.constexpr,
):  # fmt: skip
    """One partial softmax (normalized output, log2-sum-exp) of rows (seq, heads) over one
    key range; scratch layout [num_decodes, NUM_HEADS, NUM_PARTS, (HEAD_DIM)], contiguous."""
    row = (seq * NUM_HEADS + heads) * NUM_PARTS + part
    offs_d = tl.arange(0, HEAD_DIM)
    tl.store(part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], out, mask=mask[:, None])
    tl.store(part_lse_ptr + row, lse, mask=mask)
