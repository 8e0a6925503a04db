"""The Triton GEMV (batch-1 linear layers) against a float64 matmul, its fused prologues
(residual add + RMSNorm, SiLU * up) against the separate ops they replace, and the fused ops
of layers/fused.py that run them (`rms_norm_linear`, `silu_mul_linear`): the GEMV with its
prologue for one 16-bit row, the separate ops for anything else.

On CPU the kernel runs through the Triton interpreter in a subprocess (TRITON_INTERPRET must
be set before triton is imported); on a GPU through `ops.gemv.linear`, as the layers call it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from tests.triton_interpreter import needs_triton, run_interpreted


def check_gemv(device: str, dtype: torch.dtype) -> None:
    from minivllm.worker.ops.gemv import GemvConfig, gemv, gemv_config

    gen = torch.Generator().manual_seed(0)
    for m, n, k in ((1, 64, 512), (2, 96, 1024), (4, 32, 768), (1, 4096, 1024), (3, 32, 512),
                    (4, 16, 2048)):  # fmt: skip
        cfg = gemv_config(n, k) if device == "cuda" else GemvConfig(4, 256, 4, 2)
        x = torch.randn(m, k, generator=gen).to(device, dtype)
        w = (torch.randn(n, k, generator=gen) * 0.05).to(device, dtype)
        want = x.double() @ w.double().T
        got = gemv(x, w, cfg).double()
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    assert gemv_config(1000, 1024) is not None and gemv_config(1002, 1024) is None
    assert gemv_config(1024, 100) is None  # no K slice divides 100
    with pytest.raises(ValueError, match="does not tile"):
        gemv(torch.ones(5, 512), torch.ones(8, 512), GemvConfig(4, 256, 4, 2))


def check_fused_prologues(device: str, dtype: torch.dtype) -> None:
    from minivllm.worker.ops.gemv import GemvConfig, gemv_config, gemv_rms_norm, gemv_silu_mul
    from minivllm.worker.ops.norm import fused_add_rms_norm_torch, rms_norm_torch

    gen = torch.Generator().manual_seed(1)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    for m, n, k in ((1, 64, 512), (2, 32, 1024), (1, 1024, 1024), (1, 16, 256), (2, 8, 256),
                    (3, 16, 512), (4, 8, 256)):  # fmt: skip
        cfg = gemv_config(n, k) if device == "cuda" else GemvConfig(4, 256, 4, 2)
        x = torch.randn(m, k, generator=gen).to(device, dtype)
        res = torch.randn(m, k, generator=gen).to(device, dtype)
        nw = (1 + 0.1 * torch.randn(k, generator=gen)).to(device, dtype)
        w = (torch.randn(n, k, generator=gen) * 0.05).to(device, dtype)
        normed, want_res = fused_add_rms_norm_torch(x, res, nw, 1e-6)
        got_res = torch.full_like(x, float("nan"))
        got = gemv_rms_norm(x, res, nw, 1e-6, w, cfg, got_res)
        assert torch.equal(got_res, want_res)  # the new residual stream, written once
        torch.testing.assert_close(got.double(), normed.double() @ w.double().T, atol=tol, rtol=tol)
        got = gemv_rms_norm(x, None, nw, 1e-6, w, cfg)
        want = rms_norm_torch(x, nw, 1e-6).double() @ w.double().T
        torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)

        gate_up = torch.randn(m, 2 * k, generator=gen).to(device, dtype)
        act = torch.nn.functional.silu(gate_up[:, :k]) * gate_up[:, k:]
        got = gemv_silu_mul(gate_up, w, cfg)
        torch.testing.assert_close(got.double(), act.double() @ w.double().T, atol=tol, rtol=tol)


@contextmanager
def counting_prologue_gemvs() -> Iterator[Counter]:
    """Counts the fused ops' launches of the GEMV with a norm or a SiLU prologue."""
    from minivllm.worker.layers import fused

    calls: Counter = Counter()
    originals = {name: getattr(fused, name) for name in ("gemv_rms_norm", "gemv_silu_mul")}

    def counted(name: str):  # noqa: ANN202
        def launch(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            calls[name] += 1
            return originals[name](*args, **kwargs)

        return launch

    for name in originals:
        setattr(fused, name, counted(name))
    try:
        yield calls
    finally:
        for name, original in originals.items():
            setattr(fused, name, original)


def check_fused_linear_ops(device: str) -> None:
    """rms_norm_linear and silu_mul_linear on bfloat16 layers: one to four rows go through one
    GEMV with the prologue (the new residual written by it), equal to the norm or SiLU, then
    the linear; five rows, a biased projection or a strided residual take the separate ops."""
    from minivllm.worker.distributed.parallel_state import TPGroup
    from minivllm.worker.layers.fused import rms_norm_linear, silu_mul_linear
    from minivllm.worker.layers.linear import ColumnParallelLinear, RowParallelLinear
    from minivllm.worker.layers.norm import RMSNorm
    from minivllm.worker.ops.activation import silu_and_mul_torch
    from minivllm.worker.ops.norm import fused_add_rms_norm_torch, rms_norm_torch

    gen = torch.Generator().manual_seed(2)
    bf16, tp, k, n = torch.bfloat16, TPGroup(), 512, 64

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * scale).to(device, bf16)

    norm = RMSNorm(k, 1e-6, bf16).to(device)
    norm.weight.copy_(1 + rand(k, scale=0.1))
    proj = ColumnParallelLinear(k, n, tp, params_dtype=bf16).to(device)
    biased = ColumnParallelLinear(k, n, tp, bias=True, params_dtype=bf16).to(device)
    down = RowParallelLinear(k, n, tp, params_dtype=bf16).to(device)
    for layer in (proj, biased, down):
        layer.weight.copy_(rand(n, k, scale=0.05))
    biased.bias.copy_(rand(n, scale=0.1))

    def close(got: torch.Tensor, want: torch.Tensor) -> None:
        torch.testing.assert_close(got.double(), want.double(), atol=2e-2, rtol=2e-2)

    # rows, projection, a strided residual, whether the GEMV takes it
    for rows, layer, strided, fused in (
        (1, proj, False, True),
        (2, proj, False, True),
        (4, proj, False, True),
        (5, proj, False, False),
        (1, biased, False, False),
        (1, proj, True, False),
    ):
        x = rand(rows, k)
        residual = rand(rows, 2 * k)[:, ::2] if strided else rand(rows, k)
        before = (x.clone(), residual.clone())
        normed, want_residual = fused_add_rms_norm_torch(x, residual, norm.weight, 1e-6)
        bias = None if layer.bias is None else layer.bias.double()
        want = torch.nn.functional.linear(normed.double(), layer.weight.double(), bias)
        with counting_prologue_gemvs() as calls:
            got, got_residual = rms_norm_linear(x, residual, norm, layer, tp)
        assert calls["gemv_rms_norm"] == int(fused), (rows, strided, calls)
        close(got, want)
        assert torch.equal(got_residual, want_residual)
        assert torch.equal(x, before[0]) and torch.equal(residual, before[1])

        # the first layer: no residual stream yet, x starts it (the stride was the residual's)
        with counting_prologue_gemvs() as calls:
            got, got_residual = rms_norm_linear(x, None, norm, layer, tp)
        assert calls["gemv_rms_norm"] == int(fused or strided), calls
        normed = rms_norm_torch(x, norm.weight, 1e-6)
        close(got, torch.nn.functional.linear(normed.double(), layer.weight.double(), bias))
        assert got_residual is x

    for rows in (1, 3, 5):
        gate_up = rand(rows, 2 * k)
        want = silu_and_mul_torch(gate_up).double() @ down.weight.double().T
        with counting_prologue_gemvs() as calls:
            got = silu_mul_linear(gate_up, down)
        assert calls["gemv_silu_mul"] == int(rows <= 4), calls
        close(got, want)


def check_rows_taken(device: str) -> None:
    """Several rows go to the GEMV only where K is small: for Qwen3-8B's layers cuBLAS is
    faster from two rows on."""
    from minivllm.worker.ops.gemv import MAX_ROWS_K, gpu_rows

    def rows(m: int, k: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        return torch.zeros(m, k, dtype=dtype, device=device)

    assert gpu_rows(rows(1, 4096), 4096) and gpu_rows(rows(4, MAX_ROWS_K), MAX_ROWS_K)
    assert not gpu_rows(rows(2, 4096), 4096) and not gpu_rows(rows(5, 512), 512)
    assert not gpu_rows(rows(1, 512, torch.float32), 512)


@needs_triton
def test_gemv_interpreted() -> None:
    run_interpreted(__file__)


@pytest.mark.gpu
def test_gemv_gpu() -> None:
    import torch.nn.functional as F

    from minivllm.worker.ops.gemv import linear

    check_gemv("cuda", torch.bfloat16)
    check_fused_prologues("cuda", torch.bfloat16)
    check_fused_linear_ops("cuda")
    check_rows_taken("cuda")
    x = torch.randn(1, 3072, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1024, 3072, device="cuda", dtype=torch.bfloat16) * 0.02
    torch.testing.assert_close(linear(x, w), F.linear(x, w), atol=2e-2, rtol=2e-2)


if __name__ == "__main__":
    check_gemv("cpu", torch.float32)
    check_fused_prologues("cpu", torch.float32)
    check_fused_linear_ops("cpu")
    check_rows_taken("cpu")
    print("ok")
