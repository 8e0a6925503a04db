"""FP8 experts of a mixture of experts (W8A8, as vLLM's `Fp8MoEMethod`): e4m3 expert weights
with float32 scales in the checkpoint's layout, activations quantized at run time.

| scales | checkpoint | parameters | activations |
|---|---|---|---|
| block | 128x128 blocks: `weight_scale_inv` (Qwen3-*-FP8), `weight_scale` (compressed-tensors) | w13 [E, 2I/128, H/128] (a row per weight row where I is not whole blocks), w2 [E, H/128, I/128] | per token and group of 128 |
| channel | `weight_scale` [N, 1] (FP8_DYNAMIC); online: quantized at load | w13 [E, 2I, 1], w2 [E, H, 1] | per token |
| tensor | `weight_scale` [] per expert and part (Mixtral-FP8); `input_scale` with static activations | as channel, each row the part's scale | per token, or one static scale per stack (the max over the experts) |

The GPU runs the grouped FP8 GEMMs of ops/fused_moe.py (`fused_experts_fp8`); the CPU
dequantizes each expert it routes to and multiplies as the unquantized path does.
"""

from __future__ import annotations

import torch
from torch import nn

from minivllm.worker.layers.quantization.base import FusedMoEMethod, ShardSpec, replace_param
from minivllm.worker.ops import fp8_gemm as ops
from minivllm.worker.ops.fused_moe import (
    DequantizedExperts,
    Fp8Experts,
    Fp8Operand,
    fused_experts_fp8,
    fused_experts_torch,
)

SCALES = ("block", "channel", "tensor", "online")


class Fp8MoEMethod(FusedMoEMethod):
    def __init__(
        self, scales: str, scale_name: str = "weight_scale", static_input: bool = False
    ) -> None:
        if scales not in SCALES:
            raise ValueError(f"scales must be one of {SCALES}, got {scales!r}")
        self.scales, self.scale_name, self.static_input = scales, scale_name, static_input
        self.scale_rows = 1  # rows of each expert's w13 per scale row

    def create_weights(self, layer: nn.Module, dtype: torch.dtype) -> None:
        if self.scales == "online":  # the checkpoint's 16-bit weights, quantized after loading
            layer.add_param("w13_weight", layer.w13_shape, dtype)
            layer.add_param("w2_weight", layer.w2_shape, dtype)
            return
        layer.add_param("w13_weight", layer.w13_shape, ops.FP8)
        layer.add_param("w2_weight", layer.w2_shape, ops.FP8)
        (local, rows13, hidden), inter = layer.w13_shape, layer.inter
        if self.scales == "block":
            if layer.split and inter % ops.BLOCK:
                raise ValueError(
                    f"FP8 block-wise experts: {inter} intermediate features per rank are not "
                    f"whole {ops.BLOCK}-blocks, so this tensor-parallel split cuts the scale "
                    "blocks; use a tensor_parallel_size that keeps them whole, or "
                    "enable_expert_parallel"
                )
            # gate and up each start on a block only where I is whole blocks
            self.scale_rows = ops.BLOCK if inter % ops.BLOCK == 0 else 1
            blocks = -(-hidden // ops.BLOCK), -(-inter // ops.BLOCK)
            spec13 = ShardSpec(0, None, self.scale_rows, row_block=ops.BLOCK // self.scale_rows)
            shape13 = (local, rows13 // self.scale_rows, blocks[0])
            layer.add_param(f"w13_{self.scale_name}", shape13, torch.float32, spec13)
            spec2 = ShardSpec(None, 1, input_div=ops.BLOCK)
            layer.add_param(f"w2_{self.scale_name}", (local, *blocks), torch.float32, spec2)
            return
        tensor = self.scales == "tensor"
        spec13 = ShardSpec(0, None, broadcast_rows=tensor)
        layer.add_param("w13_weight_scale", (local, rows13, 1), torch.float32, spec13)
        spec2 = ShardSpec(None, None, broadcast_rows=tensor)
        layer.add_param("w2_weight_scale", (local, hidden, 1), torch.float32, spec2)
        if self.static_input:
            spec = ShardSpec(None, None, max_of_shards=True)
            for stack in ("w13", "w2"):
                layer.add_param(f"{stack}_input_scale", (1,), torch.float32, spec, fill=0.0)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if self.scales != "online":
            return
        for stack in ("w13", "w2"):  # per row of each expert, as the dense layers
            w = getattr(layer, f"{stack}_weight").data
            q = torch.empty(w.shape, dtype=ops.FP8, device=w.device)
            scale = torch.empty(*w.shape[:2], 1, dtype=torch.float32, device=w.device)
            for e in range(w.shape[0]):  # one expert's float32 copy at a time
                q[e], s = ops.quantize_weight_channel(w[e])
                scale[e] = s[:, None]
            replace_param(layer, f"{stack}_weight", q)
            replace_param(layer, f"{stack}_weight_scale", scale)

    def experts(self, layer: nn.Module) -> Fp8Experts:
        name = "weight_scale" if self.scales != "block" else self.scale_name
        w13 = Fp8Operand(layer.w13_weight, getattr(layer, f"w13_{name}"), self.scale_rows)
        w2_rows = ops.BLOCK if self.scales == "block" else 1
        w2 = Fp8Operand(layer.w2_weight, getattr(layer, f"w2_{name}"), w2_rows)
        if self.static_input:
            return Fp8Experts(w13, w2, False, layer.w13_input_scale, layer.w2_input_scale)
        return Fp8Experts(w13, w2, self.scales == "block")

    def apply(
        self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        experts = self.experts(layer)
        if ops.fp8_kernels(x):
            return fused_experts_fp8(
                x, experts, topk_weights, topk_ids, layer.num_experts, layer.first_expert
            )
        w13, w2 = (DequantizedExperts(op, x.dtype) for op in (experts.w13, experts.w2))
        return fused_experts_torch(x, w13, w2, topk_weights, topk_ids, layer.first_expert)
