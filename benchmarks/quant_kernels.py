"""The quantized GEMMs in `python benchmarks/kernels.py --only quant`, at Qwen3-8B's layer
shapes on a CUDA GPU, each checked against its torch reference, then timed against the bf16
matmul of the same shape (the GEMV for one row, cuBLAS beyond); and Qwen3-30B-A3B's experts in FP8
blocks against bf16, the whole MoE layer replayed in a CUDA graph. TB/s: the bytes of the
weight and its scales each call must read (of the experts: those routed to), over its time
(the H100's device copy runs at ~3.0)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

# Qwen3-8B: qkv, o, gate_up, down (N, K)
SHAPES = ((6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288))
ROWS = (1, 4, 256, 2048)


def _fp8_block(w: torch.Tensor) -> tuple[Callable, int]:
    from minivllm.worker.layers.quantization.fp8 import Fp8BlockLinearMethod
    from minivllm.worker.ops import fp8_gemm as ops

    q, s = ops.quantize_weight_block(w)
    method, layer = Fp8BlockLinearMethod(), _Layer(weight=q, weight_scale_inv=s)
    method.process_weights_after_loading(layer)  # cuBLAS where it has block scales
    return lambda x: method.apply(layer, x), q.nbytes + s.nbytes


def _fp8_channel(w: torch.Tensor) -> tuple[Callable, int]:
    from minivllm.worker.layers.quantization.fp8 import Fp8ChannelLinearMethod
    from minivllm.worker.ops import fp8_gemm as ops

    q, s = ops.quantize_weight_channel(w)
    layer = _Layer(weight=q, weight_scale=s.view(-1, 1))
    return lambda x: Fp8ChannelLinearMethod().apply(layer, x), q.nbytes + s.nbytes


def _awq(w: torch.Tensor) -> tuple[Callable, int]:
    from minivllm.worker.layers.quantization.awq import AwqLinearMethod, awq_checkpoint_tensors

    method, layer = AwqLinearMethod(128), _Layer(**awq_checkpoint_tensors(w, 128))
    method.process_weights_after_loading(layer)
    nbytes = sum(p.nbytes for p in layer.parameters())
    return lambda x: method.apply(layer, x), nbytes


class _Layer(torch.nn.Module):
    def __init__(self, **params: torch.Tensor) -> None:
        super().__init__()
        for name, t in params.items():
            self.register_parameter(name, torch.nn.Parameter(t, requires_grad=False))


FORMATS = {"fp8 block": _fp8_block, "fp8 channel": _fp8_channel, "awq int4": _awq}


def reference(name: str, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """What each format computes, from the float W it was quantized from."""
    from minivllm.worker.ops import fp8_gemm as ops
    from minivllm.worker.ops.w4a16 import w4_linear_torch

    if name == "fp8 block":
        return ops.block_w8a8_torch(x, *ops.quantize_weight_block(w))
    if name == "fp8 channel":
        return ops.channel_w8a8_torch(x, *ops.quantize_weight_channel(w))
    from minivllm.worker.layers.quantization.awq import AwqLinearMethod, awq_checkpoint_tensors

    method, layer = AwqLinearMethod(128), _Layer(**awq_checkpoint_tensors(w, 128))
    method.process_weights_after_loading(layer)
    return w4_linear_torch(x, method.weights(layer))


def bench_quant(rows: list, bench: Callable[[Any], float]) -> None:
    from minivllm.worker.ops.gemv import linear

    bench_fp8_moe(rows, bench)
    for n, k in SHAPES:
        w = torch.randn(n, k, device="cuda") * 0.02
        w16 = w.to(torch.bfloat16)
        kernels = {name: make(w) for name, make in FORMATS.items()}
        for m in ROWS:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            bf16_us = bench(lambda x=x, w16=w16: linear(x, w16))
            for name, (fn, nbytes) in kernels.items():
                shape = f"{m}x{n}x{k}, {name}"
                try:
                    torch.testing.assert_close(
                        fn(x).float(), reference(name, x, w).float(), atol=2e-2, rtol=2e-2
                    )
                    us = bench(lambda fn=fn, x=x: fn(x))
                except Exception as e:  # noqa: BLE001 - a shape that fails is a result too
                    rows.append(("quantized linear", shape, float("nan"), f"failed: {e!r:.80}"))
                    continue
                note = (
                    f"{nbytes / us / 1e6:.2f} TB/s W; bf16 {bf16_us:.1f} µs ({bf16_us / us:.2f}x)"
                )
                rows.append(("quantized linear", shape, us, note))


def bench_fp8_moe(rows: list, bench: Callable[[Any], float]) -> None:
    """One Qwen3-30B-A3B MoE layer (routing included) with its experts in 128x128 FP8 blocks
    against the same experts in bf16, checked against the dequantized experts in torch."""
    from moe_kernels import SHAPES as MOE_SHAPES
    from moe_kernels import _captured, _layer, _touched_bytes

    from minivllm.worker.ops.fused_moe import (
        DequantizedExperts,
        fused_experts,
        fused_experts_fp8,
        fused_experts_torch,
    )
    from minivllm.worker.ops.moe_routing import select_experts

    shape = MOE_SHAPES["qwen3-30b-a3b"]
    num_experts, top_k = shape[1], shape[2]
    for num_tokens in (1, 64, 256, 2048):
        w = _layer(shape, num_tokens)
        experts = _fp8_block_experts(w["w13"], w["w2"])

        def layer(w: dict = w, experts: Any = experts, fp8: bool = True) -> torch.Tensor:
            weights, ids = select_experts(w["logits"], top_k, True)
            if fp8:
                return fused_experts_fp8(w["x"], experts, weights, ids, num_experts)
            return fused_experts(w["x"], w["w13"], w["w2"], weights, ids, num_experts)

        weights, ids = select_experts(w["logits"], top_k, True)
        deq = [DequantizedExperts(op, torch.bfloat16) for op in (experts.w13, experts.w2)]
        label = f"qwen3-30b-a3b, {num_tokens} tok, fp8 block"
        want = fused_experts_torch(w["x"], *deq, weights, ids).float()
        # both GEMMs' activations rounded to e4m3 (3 mantissa bits): ~4.5% (rms) off
        # unquantized ones; a wrong kernel is off by ~100%
        error = float((layer().float() - want).norm() / want.norm())
        if not error < 0.1:
            rows.append(("fp8 moe", label, float("nan"), f"wrong: relative error {error:.3f}"))
            continue
        us = bench(_captured(layer).replay)
        bf16_us = bench(_captured(lambda w=w: layer(w, fp8=False)).replay)
        touched = _touched_bytes(ids, shape, w) / 2  # one byte a weight (scales: 0.02%)
        note = (
            f"{touched / us / 1e6:.2f} TB/s of experts; bf16 {bf16_us:.0f} µs "
            f"({bf16_us / us:.2f}x); error {error:.3f} of the dequantized experts' output"
        )
        rows.append(("fp8 moe", label, us, note))


def _fp8_block_experts(w13: torch.Tensor, w2: torch.Tensor) -> Any:
    """Experts [E, N, K] quantized in 128x128 blocks, as Qwen3-30B-A3B-FP8 stores them."""
    from minivllm.worker.ops import fp8_gemm as ops
    from minivllm.worker.ops.fused_moe import Fp8Experts, Fp8Operand

    def stack(w: torch.Tensor) -> Fp8Operand:
        blocks = [ops.quantize_weight_block(e) for e in w]
        q, s = (torch.stack([b[i] for b in blocks]) for i in (0, 1))
        return Fp8Operand(q, s, ops.BLOCK)

    return Fp8Experts(stack(w13), stack(w2), per_group=True)
