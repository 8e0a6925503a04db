"""The experts of a mixture-of-experts layer: for each token, the sum over its top-k experts
of weight * down(silu(gate(x)) * up(x)).

On the GPU two grouped GEMMs in Triton (vLLM's fused_moe kernel), over the slots sorted by
expert into blocks (ops/moe_routing.py): a program takes one block of BLOCK_M slots, all
routed to one expert, and BLOCK_N output features, and streams that expert's weight rows
in BLOCK_K slices. The first kernel computes the gate and the up tile side by side and
stores silu(gate) * up; the second multiplies by the down projection and the routing
weight; the k rows of each token are then summed. The grid runs the blocks of one weight
tile next to each other, so an expert whose slots fill several blocks reads its weights
from DRAM once and from L2 for the other blocks; a decode step reads each touched expert
once. Tile sizes follow the slots per expert (`moe_tile_config`).

`fused_experts_torch` is the reference (and the CPU path): a loop over the experts that
have slots, with index_select and index_add.

Weights: w13 [E, 2I, H] (each expert's gate rows, then its up rows) and w2 [E, H, I], the
experts of this rank (all of them under tensor parallelism, each sliced along I; a range
of whole experts under expert parallelism, numbered from `first_expert`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from minivllm.worker.ops._triton import tl, triton
from minivllm.worker.ops.activation import silu_and_mul_torch, silu_mul
from minivllm.worker.ops.moe_routing import ExpertBlocks, align_to_blocks


class MoETileConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def moe_tile_config(
    num_tokens: int, top_k: int, num_experts: int, dtype_bytes: int = 2
) -> MoETileConfig:
    """Tiles by the slots an expert gets on average: decode (up to a few dozen per expert)
    pads each expert's slots to one or two blocks of 32, so its weights are read once with
    little wasted work; prefill takes tiles that reuse each weight tile over many rows.
    Float32 halves BLOCK_K, so the pipeline's stages fit in shared memory. (On an H200, at
    Qwen3-30B-A3B's 256-token decode, the decode tiles read the experts at 4.0 TB/s in
    gate_up and 3.5 TB/s in down; see benchmarks/RESULTS.md.)"""
    per_expert = num_tokens * top_k / num_experts
    if per_expert <= 48:
        cfg = MoETileConfig(32, 128, 128, 4, 3)
    elif per_expert <= 192:
        cfg = MoETileConfig(64, 128, 64, 4, 3)
    else:
        cfg = MoETileConfig(128, 128, 64, 8, 3)
    return cfg._replace(block_k=cfg.block_k * 2 // dtype_bytes)


@triton.jit
def _expert_gemm_kernel(
    a_ptr, w_ptr, out_ptr, weights_ptr,
    sorted_ptr, block_experts_ptr, num_padded_ptr,
    num_slots, N, K, stride_am, stride_we, stride_wn, stride_om,
    A_ROWS_PER_SLOT: tl.constexpr, GATE_UP: tl.constexpr, MUL_WEIGHTS: tl.constexpr,
    EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """out[slot, n] for the slots of block pid_m and the features of tile pid_n:
    GATE_UP: silu(a W_gate^T) * (a W_up^T) with W_up the N rows after W_gate; else
    a W^T (times the slot's routing weight with MUL_WEIGHTS). Row a of a slot is
    slot // A_ROWS_PER_SLOT (the token's row: top_k; the slot's own row: 1)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    slots = tl.load(sorted_ptr + offs_m)
    row_ok = slots < num_slots
    a_rows = (slots // A_ROWS_PER_SLOT).to(tl.int64)
    expert = tl.load(block_experts_ptr + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_wn = offs_n % N  # the tail tile reads valid rows; its extra columns are not stored
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :]
    w_ptrs = w_ptr + expert * stride_we + offs_wn[None, :] * stride_wn + offs_k[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
            w = tl.load(w_ptrs)
        else:
            k_ok = offs_k < K - k
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None], other=0.0)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
        if GATE_UP:
            if EVEN_K:
                w_up = tl.load(w_ptrs + N * stride_wn)
            else:
                w_up = tl.load(w_ptrs + N * stride_wn, mask=k_ok[:, None], other=0.0)
            acc_up = tl.dot(a, w_up, acc_up, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    dtype = out_ptr.dtype.element_ty
    if GATE_UP:
        out = silu_mul(acc.to(dtype), acc_up.to(dtype))  # rounded as the torch path rounds
    else:
        out = acc
        if MUL_WEIGHTS:
            out = acc.to(dtype).to(tl.float32) * tl.load(weights_ptr + slots, mask=row_ok)[:, None]
    out_ptrs = out_ptr + slots.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, out.to(dtype), mask=row_ok[:, None] & (offs_n[None, :] < N))


def _expert_gemm(
    a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, blocks: ExpertBlocks,
    cfg: MoETileConfig, a_rows_per_slot: int, gate_up: bool, weights: torch.Tensor | None,
) -> None:  # fmt: skip
    n, k = (w.shape[1] // 2 if gate_up else w.shape[1]), w.shape[2]
    grid = (blocks.max_blocks, triton.cdiv(n, cfg.block_n))
    _expert_gemm_kernel[grid](
        a, w, out, weights if weights is not None else out,
        blocks.sorted_slots, blocks.block_experts, blocks.num_padded,
        out.shape[0], n, k, a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        A_ROWS_PER_SLOT=a_rows_per_slot, GATE_UP=gate_up, MUL_WEIGHTS=weights is not None,
        EVEN_K=k % cfg.block_k == 0,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip


def fused_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    num_experts: int,
    first_expert: int = 0,
    config: MoETileConfig | None = None,
) -> torch.Tensor:
    """x [T, H]; topk_weights float32 and topk_ids int32 [T, k] (global expert ids, of
    num_experts). Returns [T, H]: each token's sum over those of its experts this rank holds
    (w13.shape[0] of them from first_expert). Triton only; the two GEMMs plus one sum."""
    num_tokens, hidden = x.shape
    local, inter = w13.shape[0], w13.shape[1] // 2
    top_k = topk_ids.shape[1]
    cfg = config or moe_tile_config(num_tokens, top_k, num_experts, x.element_size())
    x = x.contiguous()
    blocks = align_to_blocks(topk_ids, local, cfg.block_m, first_expert)
    act = torch.empty(num_tokens * top_k, inter, dtype=x.dtype, device=x.device)
    _expert_gemm(x, w13, act, blocks, cfg, top_k, True, None)
    # slots of another rank's experts are never written: they must add nothing
    alloc = torch.zeros if local < num_experts else torch.empty
    out = alloc(num_tokens * top_k, hidden, dtype=x.dtype, device=x.device)
    _expert_gemm(act, w2, out, blocks, cfg, 1, False, topk_weights.reshape(-1))
    return out.view(num_tokens, top_k, hidden).sum(dim=1)


def fused_experts_torch(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    first_expert: int = 0,
) -> torch.Tensor:
    """`fused_experts` in torch: for each local expert with slots, in expert order (as
    transformers sums them), its tokens' rows through gate_up, SiLU * up and down, times the
    routing weights, added into the output (in float32, rounded once)."""
    num_tokens, top_k = topk_ids.shape
    local = w13.shape[0]
    ids = topk_ids.reshape(-1).long() - first_expert
    ids = torch.where((ids >= 0) & (ids < local), ids, local)  # another rank's: last
    order = torch.argsort(ids, stable=True)
    counts = torch.bincount(ids, minlength=local + 1)[:local].tolist()
    weights = topk_weights.reshape(-1)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        slots = order[start : start + n]
        start += n
        tokens = slots // top_k
        h = silu_and_mul_torch(F.linear(x.index_select(0, tokens), w13[e]))
        y = F.linear(h, w2[e]) * weights[slots, None]
        out.index_add_(0, tokens, y.float())
    return out.to(x.dtype)
