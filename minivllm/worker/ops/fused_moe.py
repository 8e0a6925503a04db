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

`fused_experts_fp8` runs the same kernels on e4m3 operands (W8A8, as vLLM's FP8 MoE): x
quantized per token and group of 128 (block-scaled weights) or per token, and SiLU * up
again before the second GEMM; each BLOCK_K slice's dot is scaled by its activation and weight
scales (per token and per channel: the same scale in every slice).

`fused_experts_torch` is the reference (and the CPU path): a loop over the experts that
have slots, with index_select and index_add; FP8 experts enter it dequantized one at a time
(`DequantizedExperts`).

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
from minivllm.worker.ops.fp8_gemm import (
    BLOCK,
    dequantize_block,
    dequantize_channel,
    quantize_per_group,
    quantize_per_token,
    to_e4m3,
)
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
def _dot_step(a, w, acc, a_scale, w_scale_ptrs, FP8: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """acc + a w, the FP8 product scaled by this K slice's activation and weight scales."""
    if FP8:
        return acc + tl.dot(a, w) * a_scale[:, None] * tl.load(w_scale_ptrs)[None, :]
    return tl.dot(a, w, acc, input_precision=DOT_PRECISION)


@triton.jit
def _expert_gemm_kernel(
    a_ptr, w_ptr, out_ptr, weights_ptr, a_scale_ptr, w_scale_ptr,
    sorted_ptr, block_experts_ptr, num_padded_ptr,
    num_slots, N, K, stride_am, stride_we, stride_wn, stride_om,
    stride_asm, stride_ask, stride_wse, stride_wsn, stride_wsk,
    A_ROWS_PER_SLOT: tl.constexpr, GATE_UP: tl.constexpr, MUL_WEIGHTS: tl.constexpr,
    EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr, FP8: tl.constexpr,
    W_SCALE_ROWS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """out[slot, n] for the slots of block pid_m and the features of tile pid_n:
    GATE_UP: silu(a W_gate^T) * (a W_up^T) with W_up the N rows after W_gate; else
    a W^T (times the slot's routing weight with MUL_WEIGHTS). Row a of a slot is
    slot // A_ROWS_PER_SLOT (the token's row: top_k; the slot's own row: 1).
    FP8: e4m3 a and W, a's scale per (row, 128 columns of K) and W's per (W_SCALE_ROWS
    rows, 128 columns) of each expert (per token and per channel: a stride over K of 0)."""
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
    ws_ptrs = w_scale_ptr + expert * stride_wse + (offs_wn // W_SCALE_ROWS) * stride_wsn
    ws_up_ptrs = w_scale_ptr + expert * stride_wse + ((offs_wn + N) // W_SCALE_ROWS) * stride_wsn
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
        a_s = 1.0
        if FP8:
            a_s = tl.load(
                a_scale_ptr + a_rows * stride_asm + (k // 128) * stride_ask, mask=row_ok, other=0.0
            )
        ks = (k // 128) * stride_wsk
        acc = _dot_step(a, w, acc, a_s, ws_ptrs + ks, FP8, DOT_PRECISION)
        if GATE_UP:
            if EVEN_K:
                w_up = tl.load(w_ptrs + N * stride_wn)
            else:
                w_up = tl.load(w_ptrs + N * stride_wn, mask=k_ok[:, None], other=0.0)
            acc_up = _dot_step(a, w_up, acc_up, a_s, ws_up_ptrs + ks, FP8, DOT_PRECISION)
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


class Fp8Operand(NamedTuple):
    """An e4m3 GEMM operand and its float32 scales, a 3-D view [rows or experts, ...]."""

    data: torch.Tensor
    scale: torch.Tensor
    scale_rows: int = 1  # rows of the operand (of each expert's W) per scale row


def _scale_strides(op: Fp8Operand | None) -> tuple[int, int, int]:
    """(per expert, per scale row, per 128 columns of K) strides of a scale: 0 over K for
    one scale for all of K (per token, per channel)."""
    if op is None:
        return 0, 0, 0
    s = op.scale if op.scale.dim() == 3 else op.scale[None]
    return s.stride(0), s.stride(1), s.stride(2) if s.shape[2] > 1 else 0


def _expert_gemm(
    a: torch.Tensor | Fp8Operand, w: torch.Tensor | Fp8Operand, out: torch.Tensor,
    blocks: ExpertBlocks, cfg: MoETileConfig, a_rows_per_slot: int, gate_up: bool,
    weights: torch.Tensor | None,
) -> None:  # fmt: skip
    fp8 = isinstance(w, Fp8Operand)
    a_op, w_op = (a, w) if fp8 else (None, None)
    a, w = (a.data, w.data) if fp8 else (a, w)
    n, k = (w.shape[1] // 2 if gate_up else w.shape[1]), w.shape[2]
    grid = (blocks.max_blocks, triton.cdiv(n, cfg.block_n))
    _, asm, ask = _scale_strides(a_op)
    _expert_gemm_kernel[grid](
        a, w, out, weights if weights is not None else out,
        a_op.scale if fp8 else out, w_op.scale if fp8 else out,
        blocks.sorted_slots, blocks.block_experts, blocks.num_padded,
        out.shape[0], n, k, a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        asm, ask, *_scale_strides(w_op),
        A_ROWS_PER_SLOT=a_rows_per_slot, GATE_UP=gate_up, MUL_WEIGHTS=weights is not None,
        EVEN_K=k % cfg.block_k == 0,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        FP8=fp8, W_SCALE_ROWS=w_op.scale_rows if fp8 else 1,
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
    cfg = config or moe_tile_config(len(x), topk_ids.shape[1], num_experts, x.element_size())
    return _grouped_experts(x, w13, w2, topk_weights, topk_ids, num_experts, first_expert, cfg)


class Fp8Experts(NamedTuple):
    """A rank's experts in FP8 (W8A8): e4m3 w13 [E, 2I, H] and w2 [E, H, I] with their scales,
    and how the activations are quantized at run time: per token and group of 128 (block
    weights), per token, or with a static scale (`*_input_scale`, one for all tokens)."""

    w13: Fp8Operand
    w2: Fp8Operand
    per_group: bool
    w13_input_scale: torch.Tensor | None = None
    w2_input_scale: torch.Tensor | None = None

    def quantize(self, x: torch.Tensor, static_scale: torch.Tensor | None) -> Fp8Operand:
        """x [M, K] -> e4m3 and its scales, as the GEMM of this weight expects."""
        if static_scale is not None:
            q = to_e4m3(x.float() / static_scale)
            return Fp8Operand(q, static_scale.view(1, 1).expand(x.shape[0], 1))
        if self.per_group:
            return Fp8Operand(*quantize_per_group(x, BLOCK))
        return Fp8Operand(*quantize_per_token(x))


def fused_experts_fp8(
    x: torch.Tensor,
    experts: Fp8Experts,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    num_experts: int,
    first_expert: int = 0,
    config: MoETileConfig | None = None,
) -> torch.Tensor:
    """`fused_experts` with FP8 weights: x (16-bit) quantized before the first GEMM, the
    intermediate SiLU * up before the second; tiles at most 128 deep (one scale per K slice)."""
    if config is None:
        config = moe_tile_config(len(x), topk_ids.shape[1], num_experts, dtype_bytes=1)
        config = config._replace(block_k=min(config.block_k, BLOCK))
    if BLOCK % config.block_k:
        raise ValueError(f"FP8 experts need a block_k that divides {BLOCK}, got {config}")
    args = (topk_weights, topk_ids, num_experts, first_expert, config, experts)
    return _grouped_experts(x, experts.w13, experts.w2, *args)


def _grouped_experts(
    x: torch.Tensor, w13: torch.Tensor | Fp8Operand, w2: torch.Tensor | Fp8Operand,
    topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_experts: int, first_expert: int,
    cfg: MoETileConfig, fp8: Fp8Experts | None = None,
) -> torch.Tensor:  # fmt: skip
    num_tokens, hidden = x.shape
    w13_data = w13.data if isinstance(w13, Fp8Operand) else w13
    local, inter = w13_data.shape[0], w13_data.shape[1] // 2
    top_k = topk_ids.shape[1]
    x = x.contiguous()
    blocks = align_to_blocks(topk_ids, local, cfg.block_m, first_expert)
    act = torch.empty(num_tokens * top_k, inter, dtype=x.dtype, device=x.device)
    a = x if fp8 is None else fp8.quantize(x, fp8.w13_input_scale)
    _expert_gemm(a, w13, act, blocks, cfg, top_k, True, None)
    # slots of another rank's experts are never written: they must add nothing
    alloc = torch.zeros if local < num_experts else torch.empty
    out = alloc(num_tokens * top_k, hidden, dtype=x.dtype, device=x.device)
    a = act if fp8 is None else fp8.quantize(act, fp8.w2_input_scale)
    _expert_gemm(a, w2, out, blocks, cfg, 1, False, topk_weights.reshape(-1))
    return out.view(num_tokens, top_k, hidden).sum(dim=1)


class DequantizedExperts:
    """FP8 experts read as 16-bit ones by `fused_experts_torch`, one expert at a time: the
    reference path (activations unquantized)."""

    def __init__(self, op: Fp8Operand, dtype: torch.dtype) -> None:
        self.op, self.dtype, self.shape = op, dtype, op.data.shape

    def __getitem__(self, e: int) -> torch.Tensor:
        w, scale = self.op.data[e], self.op.scale[e]
        if self.op.scale_rows == 1 and scale.shape[-1] == 1:  # one scale per row
            return dequantize_channel(w, scale.view(-1), self.dtype)
        return dequantize_block(w, scale, self.dtype, self.op.scale_rows)


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
