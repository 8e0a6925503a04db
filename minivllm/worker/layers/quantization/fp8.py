"""FP8 W8A8 linear layers: e4m3 weights with float32 scales, activations quantized to e4m3 at
run time (ops/fp8_gemm.py has the kernels and the arithmetic).

- `Fp8BlockLinearMethod`: a scale per 128x128 block of W (`weight_scale_inv` in Qwen3-*-FP8 and
  DeepSeek checkpoints, `weight_scale` in compressed-tensors' block scheme); activations per
  token and group of 128.
- `Fp8ChannelLinearMethod`: a scale per row of W (`weight_scale` [N, 1]; a per-tensor scale
  is copied onto the rows of its shard); activations per token, or with a static
  `input_scale` one scale for all (the max over q, k and v where they share a matmul).
- `Fp8OnlineLinearMethod`: a 16-bit checkpoint quantized at load, per row.

On a GPU with FP8 tensor cores (compute capability 8.9+) or under the Triton interpreter the
kernels run; elsewhere (the CPU) W is dequantized to x's dtype and multiplied as it is,
activations unquantized: the reference path.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.worker.layers.quantization.base import (
    PLAIN,
    FusedMoEMethod,
    LinearMethod,
    LinearShape,
    QuantizationConfig,
    ShardSpec,
    add_param,
    replace_param,
)
from minivllm.worker.layers.quantization.fp8_moe import Fp8MoEMethod
from minivllm.worker.ops import fp8_cublas
from minivllm.worker.ops import fp8_gemm as ops
from minivllm.worker.ops.fp8_gemm import fp8_kernels
from minivllm.worker.ops.fp8_gemv import fp8_gemv, fp8_gemv_config


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


class Fp8BlockLinearMethod(LinearMethod):
    scale_rows = ops.BLOCK  # W's rows per scale row (1 where a shard splits a block)
    on_cublas = False  # through `block_scaled_mm` (decided once the weights are on the device)

    def __init__(self, scale_name: str = "weight_scale_inv") -> None:
        self.scale_name = scale_name

    def create_weights(self, layer: nn.Module, shape: LinearShape, dtype: torch.dtype) -> None:
        n, k = shape.output_per_rank, shape.input_per_rank
        add_param(layer, "weight", (n, k), ops.FP8)
        k_blocks = -(-k // ops.BLOCK)
        # shards that do not start on a block (q/k/v of 64-row heads, a TP split of a block):
        # a scale row per weight row, read from the checkpoint's per-block rows
        shards, split_rows = shape.output_shards, layer.tp.size > 1 and not shape.input_split
        misaligned = any(r % ops.BLOCK for r in shards[:-1]) or (
            split_rows and shards[-1] % ops.BLOCK
        )
        self.scale_rows = 1 if misaligned else ops.BLOCK
        spec = ShardSpec(0, 1, self.scale_rows, ops.BLOCK, row_block=ops.BLOCK // self.scale_rows)
        rows = -(-n // self.scale_rows)
        add_param(layer, self.scale_name, (rows, k_blocks), torch.float32, spec)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        self.on_cublas = fp8_cublas.block_scales_on_cublas(layer.weight, self.scale_rows)

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        w, scale, rows = layer.weight, getattr(layer, self.scale_name), self.scale_rows
        if not fp8_kernels(x):
            return F.linear(x, ops.dequantize_block(w, scale, x.dtype, rows), bias)
        x = _rows(x)
        if x.shape[0] <= 4:
            cfg = fp8_gemv_config(*w.shape)
            if cfg is not None:
                return fp8_gemv(x, w, scale, rows, False, cfg, bias)
        if self.on_cublas:
            xq, xs = ops.quantize_per_group(x, ops.BLOCK, for_cublas=True)
            return fp8_cublas.block_scaled_mm(xq, xs, w, scale, x.shape[0], x.dtype, bias)
        xq, xs = ops.quantize_per_group(x, ops.BLOCK)
        return ops.scaled_fp8_gemm(xq, xs, w, scale, rows, x.dtype, bias)


class Fp8ChannelLinearMethod(LinearMethod):
    def __init__(self, per_tensor: bool = False, static_input: bool = False) -> None:
        self.per_tensor = per_tensor
        self.static_input = static_input

    def create_weights(self, layer: nn.Module, shape: LinearShape, dtype: torch.dtype) -> None:
        n, k = shape.output_per_rank, shape.input_per_rank
        add_param(layer, "weight", (n, k), ops.FP8)
        add_param(layer, "weight_scale", (n, 1), torch.float32,
                  ShardSpec(0, None, broadcast_rows=self.per_tensor))  # fmt: skip
        if self.static_input:
            add_param(layer, "input_scale", (1,), torch.float32,
                      ShardSpec(None, None, max_of_shards=True), fill=0.0)  # fmt: skip

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        w, scale = layer.weight, layer.weight_scale
        if not fp8_kernels(x):
            return F.linear(x, ops.dequantize_channel(w, scale, x.dtype), bias)
        x = _rows(x)
        if self.static_input:
            s = layer.input_scale
            xq = ops.to_e4m3(x.float() / s)
            xs = s.view(1, 1).expand(x.shape[0], 1).contiguous()
        else:
            if x.shape[0] <= 4:
                cfg = fp8_gemv_config(*w.shape)
                if cfg is not None:
                    return fp8_gemv(x, w, scale, 1, True, cfg, bias)
            xq, xs = ops.quantize_per_token(x)
        if (
            x.is_cuda
            and x.dtype == torch.bfloat16
            and w.shape[0] % 16 == 0
            and w.shape[1] % 16 == 0
        ):
            return torch._scaled_mm(xq, w.t(), scale_a=xs, scale_b=scale.view(1, -1),
                                    bias=bias, out_dtype=x.dtype)  # fmt: skip
        return ops.scaled_fp8_gemm(xq, xs, w, scale, 1, x.dtype, bias)


class Fp8OnlineLinearMethod(Fp8ChannelLinearMethod):
    """A 16-bit W loaded as it is, then quantized per row (the scale maps the row's max |w|
    to 448); activations per token, as vLLM's online fp8."""

    def create_weights(self, layer: nn.Module, shape: LinearShape, dtype: torch.dtype) -> None:
        add_param(layer, "weight", (shape.output_per_rank, shape.input_per_rank), dtype, PLAIN)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        q, scale = ops.quantize_weight_channel(layer.weight.data)
        replace_param(layer, "weight", q)
        replace_param(layer, "weight_scale", scale.view(-1, 1))


class Fp8Config(QuantizationConfig):
    """`quant_method: fp8` in config.json (block-wise with `weight_block_size`, else per
    tensor), or online quantization of a 16-bit checkpoint (`quantization="fp8"`)."""

    name = "fp8"

    def __init__(
        self,
        block: bool,
        serialized: bool = True,
        static_input: bool = False,
        ignored: list[str] | None = None,
    ) -> None:
        super().__init__(ignored)
        self.block, self.serialized, self.static_input = block, serialized, static_input

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> Fp8Config:
        scheme = config.get("activation_scheme", "dynamic")
        if scheme not in ("dynamic", "static"):
            raise ValueError(
                f"fp8: activation_scheme must be 'dynamic' or 'static', got {scheme!r}"
            )
        if config.get("fmt", "e4m3") != "e4m3":
            raise ValueError(f"fp8: fmt {config['fmt']!r} is not supported; only 'e4m3'")
        block = config.get("weight_block_size")
        if block is not None and list(block) != [ops.BLOCK, ops.BLOCK]:
            raise ValueError(f"fp8: weight_block_size {block} is not supported; only [128, 128]")
        if block is not None and scheme != "dynamic":
            raise ValueError("fp8: block-wise weights take activation_scheme 'dynamic' only")
        ignored = config.get("modules_to_not_convert") or config.get("ignored_layers")
        return cls(block is not None, True, scheme == "static", ignored)

    @classmethod
    def online(cls) -> Fp8Config:
        return cls(block=False, serialized=False)

    def method(self) -> LinearMethod:
        if not self.serialized:
            return Fp8OnlineLinearMethod()
        if self.block:
            return Fp8BlockLinearMethod()
        return Fp8ChannelLinearMethod(per_tensor=True, static_input=self.static_input)

    def moe_method(self, module: str) -> FusedMoEMethod | None:
        if self.is_ignored(module):
            return None
        if not self.serialized:
            return Fp8MoEMethod("online")
        if self.block:
            return Fp8MoEMethod("block", "weight_scale_inv")
        return Fp8MoEMethod("tensor", static_input=self.static_input)

    def checkpoint_tensors(self, module: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        if self.block:
            q, scale = ops.quantize_weight_block(weight)
            return {"weight": q, "weight_scale_inv": scale}
        if not self.serialized:
            return {"weight": weight}
        scale = weight.float().abs().amax().clamp(min=1e-12) / ops.FP8_MAX
        q = ops.to_e4m3(weight.float() / scale)
        tensors = {"weight": q, "weight_scale": scale}
        if self.static_input:
            tensors["input_scale"] = torch.tensor(1.0 / ops.FP8_MAX * 8, device=weight.device)
        return tensors
