"""Routing of a mixture-of-experts layer: each token's top-k experts and their weights, and
the token slots sorted by expert into padded blocks for the grouped GEMMs (ops/fused_moe.py).

A slot is one (token, choice) pair, numbered t * top_k + j. `align_to_blocks` is vLLM's
`moe_align_block_size`: the slots of each expert are listed one after another, each
expert's run padded to a multiple of BLOCK_M with the sentinel `num_slots`, so that every
block of BLOCK_M slots belongs to one expert and a GEMM program computes one block against
that expert's weights. Every output has a fixed size (the most blocks the slots can fill),
so the routing replays in a CUDA graph; the blocks past `num_padded` are idle.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from minivllm.worker.ops._triton import next_power_of_2, tl, triton, use_triton

_SCAN = 1024  # slots an align program reads per iteration


def select_experts_torch(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights float32 [T, k], expert ids int32 [T, k]): the top-k of softmax(logits) in
    float32, divided by their sum when `renormalize` (transformers' routers)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = probs.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


@triton.jit
def _topk_softmax_kernel(
    logits_ptr, weights_ptr, ids_ptr, stride_l, num_experts,
    TOP_K: tl.constexpr, K_POW2: tl.constexpr, BLOCK_E: tl.constexpr, RENORMALIZE: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_E)
    x = tl.load(logits_ptr + row * stride_l + offs, mask=offs < num_experts, other=-float("inf"))
    x = x.to(tl.float32)
    p = tl.exp(x - tl.max(x, 0))
    p = p / tl.sum(p, 0)
    p = tl.where(offs < num_experts, p, -1.0)  # never picked
    offs_k = tl.arange(0, K_POW2)
    weights = tl.zeros([K_POW2], dtype=tl.float32)
    ids = tl.zeros([K_POW2], dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(p, 0)
        idx = tl.min(tl.where(p == best, offs, BLOCK_E), 0)  # the lowest id among ties
        weights = tl.where(offs_k == j, best, weights)
        ids = tl.where(offs_k == j, idx, ids)
        p = tl.where(offs == idx, -1.0, p)
    if RENORMALIZE:
        weights = weights / tl.sum(weights, 0)
    tl.store(weights_ptr + row * TOP_K + offs_k, weights, mask=offs_k < TOP_K)
    tl.store(ids_ptr + row * TOP_K + offs_k, ids, mask=offs_k < TOP_K)


def select_experts(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """`select_experts_torch` in one kernel per token where Triton runs."""
    if not use_triton(router_logits):
        return select_experts_torch(router_logits, top_k, renormalize)
    num_tokens, num_experts = router_logits.shape
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=router_logits.device)
    if num_tokens:
        _topk_softmax_kernel[(num_tokens,)](
            router_logits, weights, ids, router_logits.stride(0), num_experts,
            TOP_K=top_k, K_POW2=next_power_of_2(top_k), BLOCK_E=next_power_of_2(num_experts),
            RENORMALIZE=renormalize,
        )  # fmt: skip
    return weights, ids


class ExpertBlocks(NamedTuple):
    """Slots grouped by expert in blocks of `block_m` (see the module docstring)."""

    sorted_slots: torch.Tensor  # int32 [max_blocks * block_m]; padding: num_slots
    block_experts: torch.Tensor  # int32 [max_blocks]: the local expert of each block
    num_padded: torch.Tensor  # int32 [1]: slots in use, a multiple of block_m
    block_m: int

    @property
    def max_blocks(self) -> int:
        return self.block_experts.shape[0]


@triton.jit
def _count_kernel(ids_ptr, counts_ptr, num_slots, first_expert, BLOCK: tl.constexpr):
    """counts[e] = slots routed to local expert e (program e)."""
    e = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    hits = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(0, num_slots, BLOCK):
        ids = tl.load(ids_ptr + start + offs, mask=start + offs < num_slots, other=-1)
        hits += (ids == e + first_expert).to(tl.int32)
    tl.store(counts_ptr + e, tl.sum(hits, 0))


@triton.jit
def _sort_kernel(
    ids_ptr, counts_ptr, sorted_ptr, block_experts_ptr, num_padded_ptr,
    num_slots, first_expert, num_experts,
    BLOCK_M: tl.constexpr, BLOCK: tl.constexpr, BLOCK_E: tl.constexpr,
):  # fmt: skip
    """Program e writes local expert e's slots in order at its run's start (the padded
    counts of the experts before it), pads the run, and names e in the run's blocks."""
    e = tl.program_id(0)
    offs_e = tl.arange(0, BLOCK_E)
    counts = tl.load(counts_ptr + offs_e, mask=offs_e < num_experts, other=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    start = tl.sum(tl.where(offs_e < e, padded, 0), 0)
    end = start + tl.sum(tl.where(offs_e == e, padded, 0), 0)
    if e == 0:
        tl.store(num_padded_ptr, tl.sum(padded, 0))
    offs = tl.arange(0, BLOCK)
    pos = start
    for s in range(0, num_slots, BLOCK):
        ids = tl.load(ids_ptr + s + offs, mask=s + offs < num_slots, other=-1)
        hit = (ids == e + first_expert).to(tl.int32)
        tl.store(sorted_ptr + pos + tl.cumsum(hit, 0) - 1, s + offs, mask=hit == 1)
        pos += tl.sum(hit, 0)
    offs_m = tl.arange(0, BLOCK_M)
    tl.store(sorted_ptr + pos + offs_m, num_slots, mask=pos + offs_m < end)
    for b in range(start // BLOCK_M, end // BLOCK_M, BLOCK):
        tl.store(block_experts_ptr + b + offs, e, mask=b + offs < end // BLOCK_M)


def max_padded_slots(num_slots: int, num_experts: int, block_m: int) -> int:
    """The most slots a padded sort can hold: each expert that gets any slot pads its run
    by fewer than block_m."""
    return num_slots + min(num_experts, num_slots) * (block_m - 1)


def align_to_blocks(
    topk_ids: torch.Tensor, num_local_experts: int, block_m: int, first_expert: int = 0
) -> ExpertBlocks:
    """Sort the slots of topk_ids [T, k] (global expert ids) by expert into blocks of block_m
    for the experts first_expert .. first_expert + num_local_experts - 1 (the others' slots,
    under expert parallelism another rank's, are left out). Triton only."""
    num_slots = topk_ids.numel()
    dev = topk_ids.device
    max_blocks = triton.cdiv(max_padded_slots(num_slots, num_local_experts, block_m), block_m)
    sorted_slots = torch.empty(max_blocks * block_m, dtype=torch.int32, device=dev)
    block_experts = torch.empty(max_blocks, dtype=torch.int32, device=dev)
    num_padded = torch.empty(1, dtype=torch.int32, device=dev)
    counts = torch.empty(num_local_experts, dtype=torch.int32, device=dev)
    ids = topk_ids.reshape(-1)
    grid = (num_local_experts,)
    _count_kernel[grid](ids, counts, num_slots, first_expert, BLOCK=_SCAN)
    _sort_kernel[grid](
        ids, counts, sorted_slots, block_experts, num_padded, num_slots, first_expert,
        num_local_experts, BLOCK_M=block_m, BLOCK=_SCAN, BLOCK_E=next_power_of_2(num_local_experts),
    )  # fmt: skip
    return ExpertBlocks(sorted_slots, block_experts, num_padded, block_m)
