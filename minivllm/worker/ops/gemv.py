"""y = x W^T for one to four rows (batch-1 decode): a Triton GEMV.

At batch 1 every linear layer is a matrix-vector product that reads W once; cuBLAS runs
them as GEMMs with 8-row tiles and, for N = 1024, a split-K pass plus a reduction kernel.
Here each program owns BLOCK_N output features and streams their rows of W in BLOCK_K
slices, multiplying on the CUDA cores (no tensor-core tile to pad a single row to) and
reducing in float32; the few rows of x are reloaded per slice from L1/L2.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from minivllm.worker.ops._triton import tl, triton


class GemvConfig(NamedTuple):
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, out_ptr, K, stride_xm, stride_wn, stride_om,
    M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + offs_n[:, None] * stride_wn + offs_k[None, :]
    for m in tl.static_range(M):
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            w = tl.load(w_ptrs + k)
            x = tl.load(x_ptr + m * stride_xm + k + offs_k)
            acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        y = tl.sum(acc, 1)
        tl.store(out_ptr + m * stride_om + offs_n, y.to(out_ptr.dtype.element_ty))


def gemv_config(n: int, k: int) -> GemvConfig | None:
    """The measured best shape for one row (H100, Qwen3-0.6B's layers, 28 weights in turn
    so none stays in L2): 4 features per program, 1024-wide K slices where K allows, 8 warps
    when N is small (fewer programs). None when the kernel cannot tile the shape."""
    block_k = next((b for b in (1024, 512, 256) if k % b == 0), None)
    if block_k is None or n % 4:
        return None
    return GemvConfig(4, block_k, 8 if n <= 2048 else 4, 2)


def gemv_fits(cfg: GemvConfig, m: int, n: int, k: int) -> bool:
    """The kernel has no masks: BLOCK_N must divide N and BLOCK_K divide K."""
    return 1 <= m <= 4 and n % cfg.block_n == 0 and k % cfg.block_k == 0


def gemv(x: torch.Tensor, w: torch.Tensor, cfg: GemvConfig) -> torch.Tensor:
    """x [M <= 4, K] @ w [N, K]^T -> [M, N] in x's dtype (float32 accumulation)."""
    m, k = x.shape
    n = w.shape[0]
    if not gemv_fits(cfg, m, n, k):
        raise ValueError(f"config {cfg} does not tile M={m}, N={n}, K={k}")
    assert x.stride(1) == 1 and w.stride(1) == 1
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    _gemv_kernel[(n // cfg.block_n,)](
        x, w, out, k, x.stride(0), w.stride(0), out.stride(0),
        M=m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return out
