"""Repetition, frequency and presence penalties, by vLLM's (and OpenAI's) definitions.

For a row with penalties (r, f, p) and a token with output count c that appears in the prompt
or the output: a positive logit is multiplied by 1/r, any other by r; then c * f and
(c > 0) * p are subtracted. The counts and the prompt mask live on the device, one row per
request of the persistent batch (`batch_rows` picks them), so no token list crosses from the
host. The kernel reads the logits in any dtype and writes float32: the first processing step
that needs float32 logits gets the conversion for free.
"""

from __future__ import annotations

import torch

from minivllm.worker.ops._triton import tl, triton, use_triton

_BLOCK = 2048


def apply_penalties(
    logits: torch.Tensor,
    batch_rows: torch.Tensor,
    repetition: torch.Tensor,
    frequency: torch.Tensor,
    presence: torch.Tensor,
    output_counts: torch.Tensor,
    prompt_mask: torch.Tensor,
    in_place: bool = False,
) -> torch.Tensor:
    """logits [N, V] -> penalized float32 logits [N, V], a new tensor unless `in_place` (the
    logits must then be float32).

    batch_rows int64 [N]: each row's request row in output_counts (int32 [R, V]) and
    prompt_mask (bool [R, V]); repetition, frequency, presence float32 [N] (1, 0, 0: none)."""
    state = (batch_rows, repetition, frequency, presence, output_counts, prompt_mask)
    if not use_triton(logits):
        penalized = apply_penalties_reference(logits, *state)
        return logits.copy_(penalized) if in_place else penalized
    out = logits if in_place else torch.empty_like(logits, dtype=torch.float32)
    num_rows, vocab = logits.shape
    _penalties_kernel[(num_rows, triton.cdiv(vocab, _BLOCK))](
        logits, logits.stride(0), out, out.stride(0), batch_rows, repetition, frequency,
        presence, output_counts, output_counts.stride(0), prompt_mask.view(torch.uint8),
        prompt_mask.stride(0), vocab, BLOCK=_BLOCK, num_warps=4,
    )  # fmt: skip
    return out


def apply_penalties_reference(
    logits: torch.Tensor,
    batch_rows: torch.Tensor,
    repetition: torch.Tensor,
    frequency: torch.Tensor,
    presence: torch.Tensor,
    output_counts: torch.Tensor,
    prompt_mask: torch.Tensor,
) -> torch.Tensor:
    """`apply_penalties` in torch, written as vLLM's torch path computes it."""
    logits = logits.float()
    counts = output_counts[batch_rows]
    seen = prompt_mask[batch_rows] | (counts > 0)
    penalty = torch.where(seen, repetition[:, None], 1.0)
    logits = logits * torch.where(logits > 0, 1.0 / penalty, penalty)
    logits = logits - frequency[:, None] * counts
    return logits - presence[:, None] * (counts > 0)


@triton.jit
def _penalties_kernel(
    in_ptr, stride_in, out_ptr, stride_out, rows_ptr, rep_ptr, freq_ptr, pres_ptr, counts_ptr,
    stride_counts, mask_ptr, stride_mask, vocab, BLOCK: tl.constexpr,
):  # fmt: skip
    n = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_row = offs < vocab
    x = tl.load(in_ptr + n.to(tl.int64) * stride_in + offs, mask=in_row).to(tl.float32)
    rep = tl.load(rep_ptr + n)
    freq = tl.load(freq_ptr + n)
    pres = tl.load(pres_ptr + n)
    if (rep != 1.0) | (freq != 0.0) | (pres != 0.0):  # rows without penalties only convert
        row = tl.load(rows_ptr + n)
        count = tl.load(counts_ptr + row * stride_counts + offs, mask=in_row, other=0)
        seen = tl.load(mask_ptr + row * stride_mask + offs, mask=in_row, other=0) != 0
        penalty = tl.where(seen | (count > 0), rep, 1.0)
        x = x * tl.where(x > 0, 1.0 / penalty, penalty)
        x = x - freq * count.to(tl.float32)
        x = x - pres * (count > 0).to(tl.float32)
    tl.store(out_ptr + n.to(tl.int64) * stride_out + offs, x, mask=in_row)
