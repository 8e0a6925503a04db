"""What AWQ and GPTQ share: 4-bit weights repacked at load into the layout of the W4A16
kernels (ops/w4a16.py), and the layer's matmul through them (a GEMV for up to 4 rows, a GEMM
beyond; the dequantizing reference where Triton does not run)."""

from __future__ import annotations

import torch
from torch import nn

from minivllm.worker.layers.quantization.base import LinearMethod, replace_param
from minivllm.worker.ops import w4a16 as ops
from minivllm.worker.ops._triton import use_triton

NIBBLES = 8  # 4-bit values per int32
SHIFTS = tuple(range(0, 32, 4))
# from this many rows W is dequantized to 16 bits for cuBLAS rather than fed to the W4A16
# GEMM (vLLM's AWQ threshold)
DEQUANTIZE_ROWS = 256


def unpack_words(words: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 words -> their 8 nibbles (lowest first), laid out along `dim` (8x longer)."""
    shifts = torch.tensor(SHIFTS, dtype=torch.int32, device=words.device)
    nibbles = (words.unsqueeze(-1) >> shifts) & 0xF  # [..., 8]
    nibbles = nibbles.movedim(-1, dim + 1)  # each word's 8 right after it along dim
    return nibbles.flatten(dim, dim + 1)


def pack_words(values: torch.Tensor, dim: int) -> torch.Tensor:
    """4-bit values -> int32 words of 8 consecutive ones along `dim` (the first lowest)."""
    v = values.to(torch.int64).movedim(dim, -1)
    v = v.unflatten(-1, (-1, NIBBLES))
    shifts = torch.tensor(SHIFTS, dtype=torch.int64, device=values.device)
    return ops.to_int32((v << shifts).sum(-1)).movedim(-1, dim)


def quantize_int4(
    w: torch.Tensor, group: int, symmetric: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """W [N, K] -> (q [N, K], scales [N, K/group] float16, zeros [N, K/group]) with
    w ~ (q - zero) * scale and q, zero in 0..15, as the tools compute them: symmetric
    (AutoGPTQ's default) zero 8 and max |w| -> 7.5 steps; else (AutoAWQ) the group's
    [min, max] onto 0..15."""
    n, k = w.shape
    g = w.float().view(n, k // group, group)
    if symmetric:
        scale = (2 * g.abs().amax(-1) / 15).clamp(min=1e-5).half().float()
        zero = torch.full_like(scale, 8.0)
    else:
        lo = g.amin(-1)
        scale = ((g.amax(-1) - lo).clamp(min=1e-5) / 15).half().float()
        zero = (-torch.round(lo / scale)).clamp(0, 15)
    q = (torch.round(g / scale[..., None]) + zero[..., None]).clamp(0, 15)
    return q.to(torch.int32).view(n, k), scale.half(), zero.to(torch.int32)


class W4LinearMethod(LinearMethod):
    """The loaded checkpoint layout -> `ops.W4Weights` (`to_kernel_layout`), then the kernels."""

    def __init__(self, group_size: int) -> None:
        self.group_size = group_size

    def group(self, k: int) -> int:
        return k if self.group_size == -1 else self.group_size

    def to_kernel_layout(self, layer: nn.Module) -> ops.W4Weights:
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        w = self.to_kernel_layout(layer)
        for name in ("qweight", "qzeros", "scales", "g_idx"):
            if name in layer._parameters:
                delattr(layer, name)
        replace_param(layer, "qweight", w.qweight.contiguous())
        replace_param(layer, "scales", w.scales.contiguous())
        replace_param(layer, "zeros", w.zeros.contiguous())
        for name in ("perm", "g_idx"):
            value = getattr(w, name)
            if value is not None:
                replace_param(layer, name, value.to(torch.int32).contiguous())
        layer.w4_group_size = w.group_size

    @staticmethod
    def weights(layer: nn.Module) -> ops.W4Weights:
        params = layer._parameters
        return ops.W4Weights(
            layer.qweight, layer.scales, layer.zeros, layer.w4_group_size,
            params.get("perm"), params.get("g_idx"),
        )  # fmt: skip

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        w = self.weights(layer)
        if not use_triton(x) or x.dtype == torch.float32 and x.is_cuda:
            return ops.w4_linear_torch(x, w, bias)
        x = x if x.stride(-1) == 1 else x.contiguous()
        n, k = w.qweight.shape[0], x.shape[1]
        if x.shape[0] <= 4:
            cfg = ops.w4_gemv_config(n, k, w.group_size)
            if cfg is not None:
                return ops.w4_gemv(x, w, cfg, bias)
        if x.shape[0] >= DEQUANTIZE_ROWS or ops.w4_gemm_block_k(k, w.group_size) is None:
            return ops.w4_dequantized_linear(x, w, bias)
        return ops.w4_gemm(x, w, bias)
