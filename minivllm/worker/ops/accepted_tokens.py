"""The tokens a verification step returns, in one launch: for each request, how many of its
drafts were accepted (its rows up to the first that rejects), its row of the [n, width]
token table, its last token, and which of its rows' tokens are kept.

Row r of the step belongs to request slots[r] // width, at position slots[r] % width; a
request's last row checks no draft and always rejects, so every request returns at least
one token. On the host this is ten small torch ops (about 330 µs of launches at batch 1 on
an H200 host, against the ~1 ms forward it follows); the kernel is one program per request
over every row of the step.
"""

from __future__ import annotations

import torch

from minivllm.worker.ops._triton import next_power_of_2, tl, triton, use_triton


def accepted_tokens(
    row_tokens: torch.Tensor, accept: torch.Tensor, slots: torch.Tensor, n: int, width: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """row_tokens int64 [R]: each row's token; accept bool [R]: whether the row accepts its
    draft; slots int64 [R]. Returns the table int64 [n, width] (-1 past a request's count),
    num_tokens int64 [n] (accepted drafts + 1), last int64 [n] and kept bool [R]."""
    if not use_triton(row_tokens):
        return accepted_tokens_reference(row_tokens, accept, slots, n, width)
    num_rows, device = row_tokens.numel(), row_tokens.device
    table = torch.empty((n, width), dtype=torch.int64, device=device)
    counts = torch.empty((2, n), dtype=torch.int64, device=device)  # num_tokens, last
    kept = torch.empty(num_rows, dtype=torch.bool, device=device)
    _accepted_kernel[(n,)](
        row_tokens, accept, slots, table, counts, kept, n, num_rows, width,
        BLOCK_R=next_power_of_2(num_rows), BLOCK_W=next_power_of_2(width), num_warps=1,
    )  # fmt: skip
    return table, counts[0], counts[1], kept


def accepted_tokens_reference(
    row_tokens: torch.Tensor, accept: torch.Tensor, slots: torch.Tensor, n: int, width: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`accepted_tokens` in torch (the CPU path)."""
    device = row_tokens.device
    table = torch.full((n * width,), -1, dtype=torch.int64, device=device)
    table[slots] = row_tokens
    accepted = torch.zeros(n * width, dtype=torch.int32, device=device)
    accepted[slots] = accept.to(torch.int32)
    num_tokens = accepted.view(n, width).cumprod(1).sum(1) + 1
    table = table.view(n, width)
    position = torch.arange(width, device=device)
    table = table.masked_fill(position[None, :] >= num_tokens[:, None], -1)
    last = table.gather(1, (num_tokens - 1)[:, None]).squeeze(1)
    kept = (slots % width) < num_tokens[slots // width]
    return table, num_tokens, last, kept


@triton.jit
def _accepted_kernel(
    tokens_ptr, accept_ptr, slots_ptr, table_ptr, counts_ptr, kept_ptr, n, num_rows, width,
    BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0)
    r = tl.arange(0, BLOCK_R)
    slot = tl.load(slots_ptr + r, mask=r < num_rows, other=-1)
    mine = (slot >= i * width) & (slot < (i + 1) * width)
    j = slot - i * width  # the row's position in its request
    token = tl.load(tokens_ptr + r, mask=mine, other=-1)
    accepted = tl.load(accept_ptr + r, mask=mine, other=0).to(tl.int32)
    # the first position that rejects: the number of accepted drafts
    num_accepted = tl.min(tl.where(mine & (accepted == 0), j, width), axis=0)
    num = num_accepted + 1
    tl.store(kept_ptr + r, j < num, mask=mine)
    tl.store(counts_ptr + i, num.to(tl.int64))
    tl.store(counts_ptr + n + i, tl.sum(tl.where(mine & (j == num_accepted), token, 0), axis=0))
    w = tl.arange(0, BLOCK_W)
    at = mine[None, :] & (j[None, :] == w[:, None])
    row = tl.sum(tl.where(at, token[None, :], 0), axis=1)
    tl.store(table_ptr + i * width + w, tl.where(w < num, row, -1), mask=w < width)
