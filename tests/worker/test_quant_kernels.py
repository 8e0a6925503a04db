"""The quantized GEMM kernels against their torch references: FP8 activation quantization
(per token group of 128, per token), the block-scaled FP8 GEMM and the FP8 GEMV (block and
per-channel scales), the W4A16 GEMV and GEMM (regular groups, act-order's permutation, and
per-row groups from g_idx).

On CPU the kernels run through the Triton interpreter in a subprocess (it handles e4m3
loads, stores, conversions and tl.dot; tests/triton_interpreter.py rounds its float32 ->
e4m3 conversions as the GPU does); on a GPU at real sizes (Qwen3-8B's layers), the FP8
GEMMs on tensor cores held to `assert_tensor_core_close`.
"""

from __future__ import annotations

import pytest
import torch

from tests.triton_interpreter import needs_triton, run_interpreted


def assert_tensor_core_close(
    got: torch.Tensor, want: torch.Tensor, where: str, mean_rel: float = 5e-3
) -> None:
    """An FP8 product on a GPU's tensor cores against its float32 reference. Hopper's FP8
    MMA sums each 128-deep dot in reduced precision (about 14 bits), so a few of many outputs
    land past an elementwise tolerance, and where an output is quantized again (a W8A8
    MoE's SiLU * up) a few of its e4m3 roundings flip: held to the mean error (the measure
    vLLM's FP8 kernel tests use) and, so that no tile, row or block is wrong, every element
    to a quarter of the outputs' rms. The interpreted checks hold the same kernels to
    elementwise tolerances."""
    got, want = got.float(), want.float()
    if not want.any():  # none of the slots on this rank's experts
        assert not got.any(), f"{where}: outputs where none are due"
        return
    err = (got - want).abs()
    mean = float(err.mean() / want.abs().mean())
    worst = float(err.max() / want.pow(2).mean().sqrt())
    assert mean < mean_rel and worst < 0.25, (
        f"{where}: mean error {mean:.2e} of the mean |output| (< {mean_rel}), largest "
        f"{worst:.3f} of the rms (< 0.25)"
    )


def check_fp8_activation_quant(device: str, dtype: torch.dtype) -> None:
    from minivllm.worker.ops import fp8_gemm as ops

    gen = torch.Generator().manual_seed(0)
    for m, k in ((3, 256), (5, 200), (2, 1024)):
        x = (torch.randn(m, k, generator=gen) * 4).to(device, dtype)
        x[0, :128] = 0  # an all-zero group still has a scale
        q_cublas, s_cublas = ops.quantize_per_group(x, 128, for_cublas=True)
        rows = -(-m // 4) * 4  # what cuBLASLt reads: whole groups of four rows, zero past m
        assert q_cublas.shape == (rows, k) and s_cublas.stride() == (1, rows)
        assert not q_cublas[m:].float().any()
        for (q, s), (want_q, want_s) in (
            (ops.quantize_per_group(x, 128), ops.quantize_groups_torch(x, 128)),
            ((q_cublas[:m], s_cublas[:m]), ops.quantize_groups_torch(x, 128)),
            (ops.quantize_per_token(x), ops.quantize_groups_torch(x, k)),
        ):
            torch.testing.assert_close(s, want_s, rtol=1e-6, atol=0)
            # the same e4m3 bytes (on a GPU a division a bit off may round a value or two the
            # other way: one e4m3 step at most)
            differ = q.view(torch.uint8) != want_q.view(torch.uint8)
            assert int(differ.sum()) <= (0 if device == "cpu" else q.numel() // 1000)
            step = want_q.float().abs() / 8 + 2**-9
            assert ((q.float() - want_q.float()).abs() <= step).all()


def check_fp8_gemms(device: str, dtype: torch.dtype, shapes: tuple) -> None:
    """The block and per-channel paths, GEMM for many rows and GEMV for few, against the
    float32 references (x quantized, W dequantized, then a matmul)."""
    from minivllm.worker.ops import fp8_cublas
    from minivllm.worker.ops import fp8_gemm as ops
    from minivllm.worker.ops.fp8_gemv import fp8_gemv, fp8_gemv_config

    gen = torch.Generator().manual_seed(1)
    tol = {"atol": 2e-2, "rtol": 2e-2} if dtype != torch.float32 else {"atol": 1e-3, "rtol": 1e-3}
    for m, n, k in shapes:
        x = torch.randn(m, k, generator=gen).to(device, dtype)
        w = torch.randn(n, k, generator=gen).to(device) * 0.05
        bias = torch.randn(n, generator=gen).to(device, dtype)
        wq, ws = ops.quantize_weight_block(w)
        want = ops.block_w8a8_torch(x, wq, ws, bias).float()
        xq, xs = ops.quantize_per_group(x, 128)
        got = ops.scaled_fp8_gemm(xq, xs, wq, ws, 128, dtype, bias)
        _check_gemm(got, want, device, tol, f"block gemm {m}x{n}x{k}")
        if fp8_cublas.block_scales_on_cublas(wq, 128):
            xq, xs = ops.quantize_per_group(x, 128, for_cublas=True)
            got = fp8_cublas.block_scaled_mm(xq, xs, wq, ws, m, dtype, bias)
            _check_gemm(got, want, device, tol, f"block gemm on cuBLAS {m}x{n}x{k}")
        cq, cs = ops.quantize_weight_channel(w)
        want_c = ops.channel_w8a8_torch(x, cq, cs, bias).float()
        xq, xs = ops.quantize_per_token(x)
        got = ops.scaled_fp8_gemm(xq, xs, cq, cs, 1, dtype, bias)
        _check_gemm(got, want_c, device, tol, f"channel gemm {m}x{n}x{k}")
        if m > 4:
            continue
        cfg = fp8_gemv_config(n, k)
        assert cfg is not None, (n, k)
        torch.testing.assert_close(fp8_gemv(x, wq, ws, 128, False, cfg, bias).float(), want, **tol)
        torch.testing.assert_close(
            fp8_gemv(x, cq, cs.view(-1, 1), 1, True, cfg, bias).float(), want_c, **tol
        )


def _check_gemm(got: torch.Tensor, want: torch.Tensor, device: str, tol: dict, where: str) -> None:
    if device == "cuda":
        assert_tensor_core_close(got, want, where)
    else:
        torch.testing.assert_close(got.float(), want, **tol, msg=lambda e: f"{where}: {e}")


def w4_cases(device: str, n: int, k: int, gen: torch.Generator) -> list:
    """(name, W4Weights): regular groups of 128 and of 32 (and one group), act-order rows
    sorted by group (perm), and irregular groups read from g_idx."""
    from minivllm.worker.ops.w4a16 import W4Weights, pack_along_k

    def weights(group: int, groups: int) -> tuple:
        q = torch.randint(0, 16, (n, k), generator=gen)
        scales = (torch.rand(n, groups, generator=gen) * 0.02 + 0.001).half()
        zeros = torch.randint(0, 17, (n, groups), generator=gen).to(torch.uint8)
        return pack_along_k(q).to(device), scales.to(device), zeros.to(device)

    perm = torch.randperm(k, generator=gen).int().to(device)
    g_idx = torch.sort(torch.randint(0, k // 64, (k,), generator=gen)).values.int().to(device)
    return [
        ("group 128", W4Weights(*weights(128, k // 128), 128)),
        ("group 32", W4Weights(*weights(32, k // 32), 32)),
        ("one group", W4Weights(*weights(k, 1), k)),
        ("act-order", W4Weights(*weights(128, k // 128), 128, perm=perm)),
        ("g_idx", W4Weights(*weights(64, k // 64), 64, perm=perm, g_idx=g_idx)),
    ]


def check_w4(device: str, dtype: torch.dtype, shapes: tuple) -> None:
    from minivllm.worker.ops import w4a16 as ops

    gen = torch.Generator().manual_seed(2)
    tol = {"atol": 3e-2, "rtol": 3e-2} if dtype != torch.float32 else {"atol": 1e-3, "rtol": 1e-3}
    for m, n, k in shapes:
        x = torch.randn(m, k, generator=gen).to(device, dtype)
        bias = torch.randn(n, generator=gen).to(device, dtype)
        for name, w in w4_cases(device, n, k, gen):
            xp = x if w.perm is None else x[:, w.perm.long()]
            want = (xp.double() @ ops.dequantize_w4(w, torch.float64).T + bias.double()).float()
            # the GEMM feeds tl.dot W dequantized to x's dtype (bfloat16: 8 bits), the GEMV
            # multiplies in float32
            w16 = ops.dequantize_w4(w, dtype)
            assert torch.equal(ops.w4_dequantize(w, dtype), w16), name
            w16 = w16.double()
            want_gemm = (xp.double() @ w16.T + bias.double()).float()
            got = ops.w4_gemm(x, w, bias)
            torch.testing.assert_close(
                got.float(),
                want_gemm,
                **tol,
                msg=lambda e, where=f"gemm {name} {m}x{n}x{k}": f"{where}: {e}",
            )
            got = ops.w4_dequantized_linear(x, w, bias)
            torch.testing.assert_close(
                got.float(),
                want_gemm,
                **tol,
                msg=lambda e, where=f"dequantized {name} {m}x{n}x{k}": f"{where}: {e}",
            )
            if m <= 4:
                cfg = ops.w4_gemv_config(n, k, w.group_size)
                assert cfg is not None
                got = ops.w4_gemv(x, w, cfg, bias)
                torch.testing.assert_close(
                    got.float(), want, **tol, msg=lambda e, where=f"gemv {name}": f"{where}: {e}"
                )
            # the reference path: x permuted, W dequantized, a plain matmul
            got = ops.w4_linear_torch(x.double(), w, bias.double()).float()
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def check_fused_ops_fall_back(device: str) -> None:
    """A quantized projection after a norm (or SiLU * up) on one bfloat16 row: the fused ops
    do not run the 16-bit GEMV's prologue on it but the norm, then the quantized matmul."""
    from minivllm.quantization_config import CHECKPOINT_QUANTIZATION_CONFIGS as CONFIGS
    from minivllm.worker.distributed.parallel_state import TPGroup
    from minivllm.worker.layers.fused import rms_norm_linear, silu_mul_linear
    from minivllm.worker.layers.linear import ColumnParallelLinear, RowParallelLinear
    from minivllm.worker.layers.norm import RMSNorm
    from minivllm.worker.layers.quantization import QUANTIZATION_CONFIGS
    from minivllm.worker.ops.activation import silu_and_mul_torch
    from minivllm.worker.ops.norm import fused_add_rms_norm_torch
    from tests.worker.test_gemv import counting_prologue_gemvs

    gen = torch.Generator().manual_seed(3)
    bf16, tp, k, n = torch.bfloat16, TPGroup(), 256, 128
    norm = RMSNorm(k, 1e-6, bf16).to(device)
    norm.weight.fill_(1.0)
    for method in ("fp8", "awq"):
        config = QUANTIZATION_CONFIGS[method].from_config(CONFIGS[method])
        proj = ColumnParallelLinear(k, n, tp, params_dtype=bf16, quant_config=config).to(device)
        down = RowParallelLinear(k, n, tp, params_dtype=bf16, quant_config=config).to(device)
        for layer in (proj, down):
            w = torch.randn(n, k, generator=gen) * 0.05
            for name, t in config.checkpoint_tensors("x", w).items():
                layer.weight_loader(getattr(layer, name), t)
            layer.quant_method.process_weights_after_loading(layer)
        x, res = (torch.randn(1, k, generator=gen).to(device, bf16) for _ in range(2))
        with counting_prologue_gemvs() as calls:
            got, _ = rms_norm_linear(x, res, norm, proj, tp)
            gate_up = torch.randn(1, 2 * k, generator=gen).to(device, bf16)
            got_down = silu_mul_linear(gate_up, down)
        assert not calls, calls
        normed, _ = fused_add_rms_norm_torch(x, res, norm.weight, 1e-6)
        tol = {"atol": 2e-2, "rtol": 2e-2}
        torch.testing.assert_close(got, proj.quant_method.apply(proj, normed), **tol)
        want = down.quant_method.apply(down, silu_and_mul_torch(gate_up))
        torch.testing.assert_close(got_down, want, **tol)


@needs_triton
def test_quant_kernels_interpreted() -> None:
    run_interpreted(__file__, timeout=600)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp8_kernels_gpu(dtype: torch.dtype) -> None:
    """Qwen3-8B's layers (qkv 6144x4096, o 4096x4096, gate_up 24576x4096, down 4096x12288);
    on Hopper the block-scaled GEMM on cuBLAS as well."""
    from minivllm.worker.ops import fp8_cublas
    from minivllm.worker.ops import fp8_gemm as ops

    check_fp8_activation_quant("cuda", dtype)
    cuda = tuple(int(v) for v in torch.version.cuda.split(".")[:2])
    if torch.cuda.get_device_capability() == (9, 0) and cuda >= (12, 9):
        w = torch.zeros(4096, 4096, device="cuda").to(ops.FP8)
        assert fp8_cublas.block_scales_on_cublas(w, 128), "cuBLASLt's block scales are missing"
    shapes = ((1, 6144, 4096), (4, 4096, 12288), (3, 24576, 4096), (512, 4096, 4096),
              (2048, 6144, 4096), (77, 4096, 12288))  # fmt: skip
    check_fp8_gemms("cuda", dtype, shapes)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_w4a16_kernels_gpu(dtype: torch.dtype) -> None:
    shapes = ((1, 6144, 4096), (4, 4096, 12288), (512, 4096, 4096), (77, 24576, 4096))
    check_w4("cuda", dtype, shapes)
    check_fused_ops_fall_back("cuda")


if __name__ == "__main__":
    check_fp8_activation_quant("cpu", torch.float32)
    check_fp8_activation_quant("cpu", torch.bfloat16)
    check_fp8_gemms("cpu", torch.float32, ((1, 256, 512), (3, 128, 256), (20, 192, 320)))
    check_fp8_gemms("cpu", torch.bfloat16, ((2, 64, 256), (17, 128, 384)))
    check_w4("cpu", torch.float32, ((1, 64, 256), (4, 32, 512), (19, 64, 256)))
    check_fused_ops_fall_back("cpu")
    print("ok")
