"""Logprobs of chosen tokens and the top-k, as vLLM returns them.

For each row of scores (logits, float or 16-bit): the chosen token's logprob, the `num`
largest logprobs with their token ids (descending), and the chosen token's rank, which is
vLLM's: how many tokens have a logprob >= its own (ties count, so the best token is 1).
`normalize=False` returns the scores themselves (vLLM's *_logits modes).

On CUDA, for the usual small `num`, two Triton kernels do it without a full-vocabulary
softmax: one pass over the row in tiles gives each tile's max, sum of exponentials, count of
scores >= the chosen one, and its own top `num` (as packed value-index keys); a second kernel
per row merges the tiles. Otherwise (the CPU, `num` above `MAX_TRITON_NUM`) plain torch.
"""

from __future__ import annotations

import torch

from minivllm.worker.ops._triton import next_power_of_2, tl, triton, use_triton

MAX_TRITON_NUM = 32  # larger top-k (up to the whole vocabulary) goes to torch.topk
_TILE = 4096


def gather_logprobs(
    scores: torch.Tensor, num: int, token_ids: torch.Tensor, normalize: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """scores [N, V], token_ids int64 [N] -> (ids int32 [N, 1 + num], logprobs float32
    [N, 1 + num], ranks int32 [N]); column 0 is the chosen token, then the top `num`."""
    num = min(num, scores.shape[-1])
    if use_triton(scores) and num <= MAX_TRITON_NUM and scores.stride(-1) == 1:
        return _gather_triton(scores, num, token_ids, normalize)
    return gather_logprobs_reference(scores, num, token_ids, normalize)


def gather_logprobs_reference(
    scores: torch.Tensor, num: int, token_ids: torch.Tensor, normalize: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`gather_logprobs` in torch: log_softmax in float32, torch.topk, a count for the rank."""
    values = scores.float()
    if normalize:
        values = values.log_softmax(dim=-1)
    top_values, top_ids = values.topk(num, dim=-1)
    chosen = values.gather(1, token_ids[:, None])
    ranks = (values >= chosen).sum(-1, dtype=torch.int32)
    ids = torch.cat([token_ids[:, None], top_ids], dim=1).to(torch.int32)
    return ids, torch.cat([chosen, top_values], dim=1), ranks


@triton.jit
def _sortable(x):
    """float32 -> int32 with the same order (the sign flips the rest of the bits)."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


@triton.jit
def _tile_kernel(
    scores_ptr, stride_row, token_ptr, max_ptr, sum_ptr, count_ptr, keys_ptr, vocab,
    num_tiles, NUM: tl.constexpr, NUM_PAD: tl.constexpr, TILE: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    tile = tl.program_id(1)
    offs = tile * TILE + tl.arange(0, TILE)
    in_row = offs < vocab
    row_ptr = scores_ptr + row.to(tl.int64) * stride_row
    x = tl.load(row_ptr + offs, mask=in_row, other=float("-inf")).to(tl.float32)
    chosen = tl.load(row_ptr + tl.load(token_ptr + row)).to(tl.float32)
    out = row * num_tiles + tile
    top = tl.max(x, 0)
    shifted = tl.where(top == float("-inf"), float("-inf"), x - top)  # an all -inf tile sums 0
    tl.store(max_ptr + out, top)
    tl.store(sum_ptr + out, tl.sum(tl.exp(shifted), 0))
    tl.store(count_ptr + out, tl.sum((x >= chosen).to(tl.int32), 0))
    # value in the high half, 2^32-1 - index in the low: the max key is the largest value,
    # the lowest index on ties; lanes past the row hold a key below any value's (-inf's
    # high half is -2139095041)
    keys = (_sortable(x).to(tl.int64) << 32) + (4294967295 - offs.to(tl.int64))
    keys = tl.where(in_row, keys, -9200000000000000000)
    slots = tl.arange(0, NUM_PAD)
    best = tl.full([NUM_PAD], -9200000000000000000, tl.int64)
    for k in tl.static_range(NUM):
        key = tl.max(keys, 0)
        best = tl.where(slots == k, key, best)
        keys = tl.where(keys == key, -9200000000000000000, keys)
    tl.store(keys_ptr + out * NUM_PAD + slots, best)


@triton.jit
def _merge_kernel(
    scores_ptr, stride_row, token_ptr, max_ptr, sum_ptr, count_ptr, keys_ptr, ids_ptr,
    values_ptr, ranks_ptr, num_tiles, NORMALIZE: tl.constexpr, NUM: tl.constexpr,
    NUM_PAD: tl.constexpr, TILES_PAD: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    t = tl.arange(0, TILES_PAD)
    live = t < num_tiles
    tile_max = tl.load(max_ptr + row * num_tiles + t, mask=live, other=float("-inf"))
    tile_sum = tl.load(sum_ptr + row * num_tiles + t, mask=live, other=0.0)
    top = tl.max(tile_max, 0)
    scale = tl.where(tile_max == float("-inf"), 0.0, tl.exp(tile_max - top))
    lse = top + tl.log(tl.sum(tile_sum * scale, 0))
    if not NORMALIZE:
        lse = 0.0
    count = tl.sum(tl.load(count_ptr + row * num_tiles + t, mask=live, other=0), 0)
    token = tl.load(token_ptr + row)
    chosen = tl.load(scores_ptr + row.to(tl.int64) * stride_row + token).to(tl.float32)
    out = row * (NUM + 1)
    tl.store(ids_ptr + out, token.to(tl.int32))
    tl.store(values_ptr + out, chosen - lse)
    tl.store(ranks_ptr + row, count)
    c = tl.arange(0, TILES_PAD * NUM_PAD)
    keys = tl.load(
        keys_ptr + row * num_tiles * NUM_PAD + c,
        mask=c < num_tiles * NUM_PAD,
        other=-9200000000000000000,
    )
    for k in tl.static_range(NUM):
        key = tl.max(keys, 0)
        keys = tl.where(keys == key, -9200000000000000000, keys)
        bits = (key >> 32).to(tl.int32)
        bits = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
        tl.store(ids_ptr + out + 1 + k, (4294967295 - (key & 4294967295)).to(tl.int32))
        tl.store(values_ptr + out + 1 + k, bits.to(tl.float32, bitcast=True) - lse)


def _gather_triton(
    scores: torch.Tensor, num: int, token_ids: torch.Tensor, normalize: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rows, vocab = scores.shape
    dev = scores.device
    tiles = triton.cdiv(vocab, _TILE)
    num_pad = next_power_of_2(max(num, 1))
    tile_max = torch.empty(rows, tiles, dtype=torch.float32, device=dev)
    tile_sum = torch.empty_like(tile_max)
    counts = torch.empty(rows, tiles, dtype=torch.int32, device=dev)
    keys = torch.empty(rows, tiles, num_pad, dtype=torch.int64, device=dev)
    ids = torch.empty(rows, num + 1, dtype=torch.int32, device=dev)
    values = torch.empty(rows, num + 1, dtype=torch.float32, device=dev)
    ranks = torch.empty(rows, dtype=torch.int32, device=dev)
    token_ids = token_ids.contiguous()
    _tile_kernel[(rows, tiles)](
        scores, scores.stride(0), token_ids, tile_max, tile_sum, counts, keys, vocab, tiles,
        NUM=num, NUM_PAD=num_pad, TILE=_TILE, num_warps=8,
    )  # fmt: skip
    _merge_kernel[(rows,)](
        scores, scores.stride(0), token_ids, tile_max, tile_sum, counts, keys, ids, values,
        ranks, tiles, NORMALIZE=normalize, NUM=num, NUM_PAD=num_pad,
        TILES_PAD=next_power_of_2(tiles), num_warps=4,
    )  # fmt: skip
    return ids, values, ranks
