"""`minivllm bench kernels --only quant`: the quantized GEMMs at Qwen3-8B's layer shapes on a
CUDA GPU, each checked against its torch reference, then timed against the bf16 matmul of
the same shape (the GEMV for one row, cuBLAS beyond). TB/s: the bytes of the weight and its
scales each call must read, over its time (the H100's device copy runs at ~3.0)."""

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
    layer = _Layer(weight=q, weight_scale_inv=s)
    return lambda x: Fp8BlockLinearMethod().apply(layer, x), q.nbytes + s.nbytes


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
