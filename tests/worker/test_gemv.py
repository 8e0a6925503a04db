"""The Triton GEMV (batch-1 linear layers) against a float64 matmul.

On CPU the kernel runs through the Triton interpreter in a subprocess (TRITON_INTERPRET must
be set before triton is imported); on a GPU through `ops.linear`, as the layers call it.
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


@needs_triton
def test_gemv_interpreted() -> None:
    run_interpreted(__file__)


@pytest.mark.gpu
def test_gemv_gpu() -> None:
    import torch.nn.functional as F

    from minivllm.worker.layers import ops

    check_gemv("cuda", torch.bfloat16)
    x = torch.randn(1, 3072, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1024, 3072, device="cuda", dtype=torch.bfloat16) * 0.02
    torch.testing.assert_close(ops.linear(x, w), F.linear(x, w), atol=2e-2, rtol=2e-2)


if __name__ == "__main__":
    check_gemv("cpu", torch.float32)
    print("ok")
