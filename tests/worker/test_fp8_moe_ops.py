"""The FP8 grouped GEMMs of the fused MoE layer against a float32 torch reference of W8A8
(activations quantized as the kernels quantize them, weights dequantized): block scales
(whole 128-row blocks, and a row each where the intermediate size is not whole blocks),
per-channel scales with per-token activations, and static activation scales; with even and
uneven expert loads, small tiles, and a rank's half of the experts. The dequantizing CPU
path (`DequantizedExperts`) against the experts dequantized up front.

As test_fused_moe_ops: under the Triton interpreter on CPU, at real sizes on a GPU (there
held to `assert_tensor_core_close`: the intermediate's e4m3 rounding flips wherever the
tensor cores' sums differ from float32's by a bfloat16 step).
"""

from __future__ import annotations

import pytest
import torch

from minivllm.worker.ops import fp8_gemm as ops
from minivllm.worker.ops.activation import silu_and_mul_torch
from minivllm.worker.ops.fused_moe import (
    DequantizedExperts,
    Fp8Experts,
    Fp8Operand,
    MoETileConfig,
    fused_experts_fp8,
    fused_experts_torch,
)
from tests.triton_interpreter import needs_triton, run_interpreted
from tests.worker.test_fused_moe_ops import LOADS, routed_ids
from tests.worker.test_quant_kernels import assert_tensor_core_close

KINDS = ("block", "channel", "static")


def quantize_experts(w13: torch.Tensor, w2: torch.Tensor, kind: str) -> Fp8Experts:
    """Float experts as a checkpoint quantizes them, each part on its own: 128x128 blocks of
    gate, up and down (w13's scales a row per weight row unless I is whole blocks), or a
    scale per row; "static" adds one activation scale per stack."""
    inter = w13.shape[1] // 2
    if kind == "block":
        rows = ops.BLOCK if inter % ops.BLOCK == 0 else 1
        parts = [[ops.quantize_weight_block(p) for p in e.split(inter)] for e in w13]
        scale13 = torch.stack(
            [
                torch.cat(
                    [s.repeat_interleave(ops.BLOCK // rows, 0)[: -(-inter // rows)] for _, s in e]
                )
                for e in parts
            ]  # fmt: skip
        )
        q13 = torch.stack([torch.cat([q for q, _ in e]) for e in parts])
        down = [ops.quantize_weight_block(e) for e in w2]
        q2, scale2 = torch.stack([q for q, _ in down]), torch.stack([s for _, s in down])
        return Fp8Experts(Fp8Operand(q13, scale13, rows), Fp8Operand(q2, scale2, ops.BLOCK), True)
    (q13, s13), (q2, s2) = (ops.quantize_weight_channel(w.flatten(0, 1)) for w in (w13, w2))
    w13q = Fp8Operand(q13.view(w13.shape), s13.view(*w13.shape[:2], 1))
    w2q = Fp8Operand(q2.view(w2.shape), s2.view(*w2.shape[:2], 1))
    if kind == "channel":
        return Fp8Experts(w13q, w2q, False)
    static = (torch.tensor([0.02], device=w13.device), torch.tensor([0.01], device=w13.device))
    return Fp8Experts(w13q, w2q, False, *static)


def _qdq(a: torch.Tensor, experts: Fp8Experts, static: torch.Tensor | None) -> torch.Tensor:
    """a as the kernels read it: quantized to e4m3 with its scales, in float32."""
    if static is not None:
        return (a.float() / static).clamp(-ops.FP8_MAX, ops.FP8_MAX).to(ops.FP8).float() * static
    group = ops.BLOCK if experts.per_group else a.shape[1]
    q, s = ops.quantize_groups_torch(a, group)
    return q.float() * s.repeat_interleave(group, 1)[:, : a.shape[1]]


def w8a8_experts_torch(
    x: torch.Tensor, experts: Fp8Experts, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
    first_expert: int = 0,
) -> torch.Tensor:  # fmt: skip
    """What `fused_experts_fp8` computes, token by token: each of its experts this rank holds
    in float32 on the quantized rows, SiLU * up rounded to x's dtype, down times the weight."""
    w13 = DequantizedExperts(experts.w13, torch.float32)
    w2 = DequantizedExperts(experts.w2, torch.float32)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    a = _qdq(x, experts, experts.w13_input_scale)
    for t, (ids, weights) in enumerate(zip(topk_ids.tolist(), topk_weights, strict=True)):
        for e, weight in zip(ids, weights, strict=True):
            local = e - first_expert
            if not 0 <= local < w13.shape[0]:
                continue
            h = silu_and_mul_torch((a[t : t + 1] @ w13[local].T).to(x.dtype))
            y = (_qdq(h, experts, experts.w2_input_scale) @ w2[local].T).to(x.dtype)
            out[t] += y[0].float() * weight
    return out.to(x.dtype)


def _half(experts: Fp8Experts, half: int) -> Fp8Experts:
    def cut(op: Fp8Operand) -> Fp8Operand:
        return op._replace(data=op.data[half:], scale=op.scale[half:])

    return experts._replace(w13=cut(experts.w13), w2=cut(experts.w2))


def check_fp8_experts(
    device: str, dtype: torch.dtype, sizes: tuple[int, ...], configs: list, loads=LOADS
) -> None:
    """sizes: tokens, experts, top-k, hidden, intermediate."""
    num_tokens, num_experts, top_k, hidden, inter = sizes
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(num_tokens, hidden, generator=gen).to(device, dtype)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) * hidden**-0.5).to(device)
    w2 = (torch.randn(num_experts, hidden, inter, generator=gen) * inter**-0.5).to(device)
    # float32 as well: one e4m3 step of SiLU * up that rounds the other way moves an output
    tol = {"atol": 3e-2, "rtol": 3e-2} if dtype != torch.float32 else {"atol": 1e-2, "rtol": 1e-2}
    for kind in KINDS:
        experts = quantize_experts(w13, w2, kind)
        for load in loads:
            ids = routed_ids(num_tokens, num_experts, top_k, load, gen).to(device)
            weights = torch.rand(num_tokens, top_k, generator=gen).to(device)
            ref = w8a8_experts_torch(x, experts, weights, ids).float()
            for cfg in configs:
                got = fused_experts_fp8(x, experts, weights, ids, num_experts, config=cfg)
                _check(got, ref, device, tol, f"{kind} {load} {cfg}")
            half = num_experts // 2
            got = fused_experts_fp8(x, _half(experts, half), weights, ids, num_experts, half)
            ref_half = w8a8_experts_torch(x, _half(experts, half), weights, ids, half)
            _check(got, ref_half, device, tol, f"{kind} {load} experts {half}..")


def _check(got: torch.Tensor, want: torch.Tensor, device: str, tol: dict, where: str) -> None:
    """Elementwise where the interpreter multiplies exactly; on a GPU's FP8 tensor cores as
    vLLM's FP8 MoE tests hold theirs (mean error under 3%; no element far off)."""
    if device == "cuda":
        assert_tensor_core_close(got, want, where, mean_rel=0.03)
    else:
        torch.testing.assert_close(got.float(), want.float(), **tol, msg=lambda e: f"{where}: {e}")


def test_dequantized_experts_are_the_formats_weights() -> None:
    """The CPU path reads each expert as its format defines it: block scales on their
    128x128 blocks (or a row each), per-channel scales on their rows."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(9, 256, generator=gen)
    ids = routed_ids(9, 4, 2, "hot", gen)
    weights = torch.rand(9, 2, generator=gen)
    for inter in (128, 48):
        w13 = torch.randn(4, 2 * inter, 256, generator=gen) * 0.05
        w2 = torch.randn(4, 256, inter, generator=gen) * 0.05
        for kind in ("block", "channel"):
            experts = quantize_experts(w13, w2, kind)
            want13 = torch.stack([torch.cat([_block_or_row(p, kind) for p in e.split(inter)])
                                  for e in w13])  # fmt: skip
            want2 = torch.stack([_block_or_row(e, kind) for e in w2])
            d13, d2 = (DequantizedExperts(op, torch.float32) for op in (experts.w13, experts.w2))
            assert torch.equal(torch.stack([d13[e] for e in range(4)]), want13)
            assert torch.equal(torch.stack([d2[e] for e in range(4)]), want2)
            torch.testing.assert_close(
                fused_experts_torch(x, d13, d2, weights, ids),
                fused_experts_torch(x, want13, want2, weights, ids),
            )


def _block_or_row(w: torch.Tensor, kind: str) -> torch.Tensor:
    q, s = (ops.quantize_weight_block if kind == "block" else ops.quantize_weight_channel)(w)
    if kind == "block":
        return ops.dequantize_block(q, s, torch.float32)
    return q.float() * s[:, None]


SMALL_CONFIGS = [None, MoETileConfig(16, 32, 32, 4, 2)]


@needs_triton
def test_fp8_moe_kernels_interpreted() -> None:
    run_interpreted(__file__, timeout=900)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp8_moe_kernels_gpu(dtype: torch.dtype) -> None:
    for num_tokens in (1, 64, 1024):  # decode at batch 1 and 64, a prefill chunk
        check_fp8_experts("cuda", dtype, (num_tokens, 128, 8, 2048, 768), [None], ("even",))
    check_fp8_experts("cuda", dtype, (256, 128, 8, 2048, 384), [None])  # I / 2 under TP=2
    check_fp8_experts("cuda", dtype, (64, 8, 2, 4096, 14336 // 4), [None], ("hot",))  # Mixtral
    check_fp8_experts("cuda", dtype, (100, 16, 4, 256, 96), SMALL_CONFIGS)  # a row per scale


if __name__ == "__main__":  # the interpreted run
    from minivllm.worker.ops._triton import interpreting

    assert interpreting()
    bf16 = torch.bfloat16
    check_fp8_experts("cpu", bf16, (24, 8, 2, 256, 128), SMALL_CONFIGS, ("hot",))
    check_fp8_experts(
        "cpu", bf16, (24, 8, 2, 192, 48), [MoETileConfig(16, 16, 64, 4, 2)], ("even",)
    )
    check_fp8_experts("cpu", torch.float32, (24, 8, 2, 256, 128), [None], ("empty",))
    print("ok")
