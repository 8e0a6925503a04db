"""The Triton GEMV (batch-1 linear layers) against a float64 matmul, and its fused
prologues (residual add + RMSNorm, SiLU * up) against the separate ops they replace.

On CPU the kernel runs through the Triton interpreter in a subprocess (TRITON_INTERPRET must
be set before triton is imported); on a GPU through `ops.gemv.linear`, as the layers call it.
"""

from __future__ import annotations

import pytest
import torch

from tests.triton_interpreter import needs_triton, run_interpreted


def check_gemv(device: str, dtype: torch.dtype) -> None:
    from minivllm.worker.ops.gemv import GemvConfig, gemv, gemv_config

    gen = torch.Generator().manual_seed(0)
    for m, n, k in ((1, 64, 512), (2, 96, 1024), (4, 32, 768), (1, 4096, 1024)):
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
    for m, n, k in ((1, 64, 512), (2, 32, 1024), (1, 1024, 1024), (1, 16, 256), (2, 8, 256)):
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


@needs_triton
def test_gemv_interpreted() -> None:
    run_interpreted(__file__)


@pytest.mark.gpu
def test_gemv_gpu() -> None:
    import torch.nn.functional as F

    from minivllm.worker.ops.activation import silu_and_mul
    from minivllm.worker.ops.gemv import RowPrologue, linear
    from minivllm.worker.ops.norm import fused_add_rms_norm

    check_gemv("cuda", torch.bfloat16)
    check_fused_prologues("cuda", torch.bfloat16)
    x = torch.randn(1, 3072, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1024, 3072, device="cuda", dtype=torch.bfloat16) * 0.02
    torch.testing.assert_close(linear(x, w), F.linear(x, w), atol=2e-2, rtol=2e-2)
    # the layers: at one row the linear computes the norm or SiLU*mul before it in its GEMV,
    # the same as the separate kernels
    from minivllm.worker.layers.activation import SiluAndMul
    from minivllm.worker.layers.norm import RMSNorm

    h, res = x[:, :1024].contiguous(), torch.randn_like(x[:, :1024])
    w1 = w[:, :1024].contiguous()
    norm = RMSNorm(1024, 1e-6, torch.bfloat16, feeds_linear=True).cuda()
    norm.weight.fill_(1.0)
    normed, new_res = fused_add_rms_norm(h, res, norm.weight, 1e-6)
    prologue, got_res = norm(h, res)
    assert isinstance(prologue, RowPrologue)
    torch.testing.assert_close(linear(prologue, w1), F.linear(normed, w1), atol=2e-2, rtol=2e-2)
    assert torch.equal(got_res, new_res)  # written by the GEMV
    gate_up = torch.randn(1, 6144, device="cuda", dtype=torch.bfloat16)
    want = F.linear(silu_and_mul(gate_up), w)
    got = linear(SiluAndMul()(gate_up), w)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


if __name__ == "__main__":
    check_gemv("cpu", torch.float32)
    check_fused_prologues("cpu", torch.float32)
    print("ok")
