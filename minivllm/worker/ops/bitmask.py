"""Structured outputs' token bitmask, applied to the logits of the rows it constrains.

Row i of the bitmask (int32 words, bit t % 32 of word t // 32 for token t) belongs to logits
row `rows[i]`; every token whose bit is clear gets -inf, in place. Tokens past the bitmask's
width (none, when it covers the vocabulary) are left alone; rows not named are never read or
written. The kernel only stores: a row's kept tokens cost no traffic at all.
"""

from __future__ import annotations

import numpy as np
import torch

from minivllm.worker.ops._triton import tl, triton, use_triton

_BLOCK = 4096  # tokens per program: 128 words of the bitmask


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """logits [N, V] (any float dtype), bitmask int32 [K, W], rows int64 [K] (distinct
    indices into logits): the tokens of row rows[i] that bitmask[i] clears become -inf."""
    if rows.numel() == 0:
        return
    if not use_triton(logits):
        apply_token_bitmask_reference(logits, bitmask, rows)
        return
    vocab = min(logits.shape[1], bitmask.shape[1] * 32)
    _bitmask_kernel[(rows.numel(), triton.cdiv(vocab, _BLOCK))](
        logits, logits.stride(0), bitmask, bitmask.stride(0), rows, vocab,
        BLOCK=_BLOCK, num_warps=4,
    )  # fmt: skip


def apply_token_bitmask_reference(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor
) -> None:
    """`apply_token_bitmask` on the host: unpack the bits (numpy), fill the cleared tokens."""
    vocab = min(logits.shape[1], bitmask.shape[1] * 32)
    words = bitmask.cpu().numpy().astype("<i4", copy=False)
    bits = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")[:, :vocab]
    banned = torch.zeros(len(rows), logits.shape[1], dtype=torch.bool)
    banned[:, :vocab] = torch.from_numpy(bits == 0)
    masked = logits.index_select(0, rows).masked_fill_(banned.to(logits.device), float("-inf"))
    logits.index_copy_(0, rows, masked)


@triton.jit
def _bitmask_kernel(
    logits_ptr, stride_logits, mask_ptr, stride_mask, rows_ptr, vocab, BLOCK: tl.constexpr
):  # fmt: skip
    i = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_row = offs < vocab
    words = tl.load(mask_ptr + i.to(tl.int64) * stride_mask + offs // 32, mask=in_row, other=-1)
    banned = ((words >> (offs % 32)) & 1) == 0
    row = tl.load(rows_ptr + i)
    tl.store(logits_ptr + row * stride_logits + offs, float("-inf"), mask=in_row & banned)
