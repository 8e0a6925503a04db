"""y = x W^T for the few to few hundred rows of a decode step: a Triton GEMM on the tensor
cores that starts pulling its weights into L2 before it waits for its input.

Per layer, a decode step runs each linear once on a small activation x [M, K] and a weight
W [N, K] that no other kernel of the step touches, so the weights can be requested while
the kernel before is still running: under programmatic dependent launch (`_triton.pdl`) a
program first prefetches its BLOCK_N rows of W into L2, one request per 128-byte line, then
waits for the producer of x, then runs the usual pipelined loop over K (its W tiles now
coming from L2). Without PDL the prefetch still issues all of a program's weight traffic at
once, ahead of the loop's pipeline.

SWAP computes the transposed tile (W's rows on the MMA's M side, which must be 64 wide for
Hopper's warpgroup MMA, x's few rows on its N side) and stores it transposed.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from minivllm.worker.ops._triton import pdl, tl, triton, wait_for_producers

_LINE = 64  # bf16 elements per 128-byte line


class GemmConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    swap: bool = False
    prefetch: bool = True
    tma: bool = False  # tiles through Hopper's tensor memory accelerator (no prefetch)
    warp_specialize: bool = False  # with tma: producer and consumer warps


@triton.jit
def _prefetch_l2(ptrs):
    tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1]; mov.u32 $0, 0;",
        "=r,l",
        [ptrs],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit(do_not_specialize=["M"])
def _decode_gemm_kernel(
    x_ptr, w_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SWAP: tl.constexpr, PREFETCH: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if PREFETCH:  # this program's rows of W, every 128-byte line, into L2
        lines = tl.arange(0, BLOCK_K // 64) * 64
        for k in range(0, K, BLOCK_K):
            _prefetch_l2(w_ptr + offs_n[:, None] * stride_wn + (k + lines)[None, :])
    wait_for_producers(PDL)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    if SWAP:
        w_ptrs = w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :]  # [BN, BK]
        x_ptrs = x_ptr + offs_m[None, :] * stride_xm + offs_k[:, None]  # [BK, BM]
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for _ in range(0, K, BLOCK_K):
            w = tl.load(w_ptrs)
            x = tl.load(x_ptrs, mask=m_mask[None, :], other=0.0)
            acc = tl.dot(w, x, acc)
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        out = out_ptr + offs_m[None, :] * stride_om + offs_n[:, None]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[None, :])
    else:
        x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]  # [BM, BK]
        w_ptrs = w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None]  # [BK, BN]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for _ in range(0, K, BLOCK_K):
            x = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0)
            w = tl.load(w_ptrs)
            acc = tl.dot(x, w, acc)
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        out = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None])


@triton.jit(do_not_specialize=["M"])
def _decode_gemm_tma_kernel(
    x_desc, w_desc, out_ptr, M, K, stride_om,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SWAP: tl.constexpr, WS: tl.constexpr, PDL: tl.constexpr = False,
):  # fmt: skip
    off_n = tl.program_id(0) * BLOCK_N
    off_m = tl.program_id(1) * BLOCK_M
    wait_for_producers(PDL)
    offs_m = off_m + tl.arange(0, BLOCK_M)
    offs_n = off_n + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    if SWAP:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for k in tl.range(0, K, BLOCK_K, warp_specialize=WS):
            w = w_desc.load([off_n, k])
            x = x_desc.load([off_m, k])
            acc = tl.dot(w, x.T, acc)
        out = out_ptr + offs_m[None, :] * stride_om + offs_n[:, None]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[None, :])
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k in tl.range(0, K, BLOCK_K, warp_specialize=WS):
            x = x_desc.load([off_m, k])
            w = w_desc.load([off_n, k])
            acc = tl.dot(x, w.T, acc)
        out = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None])


def decode_gemm_fits(cfg: GemmConfig, n: int, k: int) -> bool:
    """The kernel masks rows only: BLOCK_N must divide N and BLOCK_K divide K."""
    return n % cfg.block_n == 0 and k % cfg.block_k == 0 and cfg.block_k % _LINE == 0


def decode_gemm(x: torch.Tensor, w: torch.Tensor, cfg: GemmConfig) -> torch.Tensor:
    """x [M, K] @ w [N, K]^T -> [M, N] in x's dtype (float32 accumulation)."""
    m, k = x.shape
    n = w.shape[0]
    if not decode_gemm_fits(cfg, n, k):
        raise ValueError(f"config {cfg} does not tile N={n}, K={k}")
    assert x.stride(1) == 1 and w.stride(1) == 1
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    grid = (n // cfg.block_n, triton.cdiv(m, cfg.block_m))
    if cfg.tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        _decode_gemm_tma_kernel[grid](
            TensorDescriptor.from_tensor(x, [cfg.block_m, cfg.block_k]),
            TensorDescriptor.from_tensor(w, [cfg.block_n, cfg.block_k]),
            out, m, k, out.stride(0),
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SWAP=cfg.swap,
            WS=cfg.warp_specialize, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            **pdl(x),
        )  # fmt: skip
        return out
    _decode_gemm_kernel[grid](
        x, w, out, m, n, k, x.stride(0), w.stride(0), out.stride(0),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SWAP=cfg.swap,
        PREFETCH=cfg.prefetch, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl(x),
    )  # fmt: skip
    return out
