"""compressed-tensors checkpoints (llm-compressor's output, `quant_method:
compressed-tensors`): the FP8 schemes, W8A8 on the kernels of fp8.py.

| scheme | weights | activations | method |
|---|---|---|---|
| FP8_DYNAMIC | per channel (`weight_scale` [N, 1]) | dynamic per token | `Fp8ChannelLinearMethod` |
| FP8 | per tensor (`weight_scale` [1]) | static per tensor (`input_scale`) | `Fp8ChannelLinearMethod` |
| FP8_BLOCK | 128x128 blocks (`weight_scale`) | dynamic per token group of 128 | `Fp8BlockLinearMethod` |

Other schemes (integer or 4-bit weights, weight-only FP8) are refused by name.
"""

from __future__ import annotations

from typing import Any

import torch

from minivllm.worker.layers.quantization.base import (
    FusedMoEMethod,
    LinearMethod,
    QuantizationConfig,
)
from minivllm.worker.layers.quantization.fp8 import (
    Fp8BlockLinearMethod,
    Fp8ChannelLinearMethod,
)
from minivllm.worker.layers.quantization.fp8_moe import Fp8MoEMethod
from minivllm.worker.ops import fp8_gemm as ops

SUPPORTED = (
    "FP8 weights (8-bit float, symmetric) per channel, per tensor or in 128x128 blocks, with "
    "FP8 activations dynamic per token (per group of 128 for blocks) or static per tensor"
)


def _is_fp8(args: dict[str, Any] | None) -> bool:
    return (
        bool(args)
        and args.get("num_bits") == 8
        and args.get("type") == "float"
        and (args.get("symmetric", True))
    )


class CompressedTensorsConfig(QuantizationConfig):
    name = "compressed-tensors"

    def __init__(self, strategy: str, static_input: bool, ignored: list[str]) -> None:
        super().__init__(ignored)
        self.strategy, self.static_input = strategy, static_input

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> CompressedTensorsConfig:
        groups = list((config.get("config_groups") or {}).values())
        if len(groups) != 1 or "Linear" not in (groups[0].get("targets") or []):
            raise ValueError(
                "compressed-tensors: one config group targeting Linear layers is supported, "
                f"got {len(groups)} group(s)"
            )
        weights, acts = groups[0].get("weights"), groups[0].get("input_activations")
        strategy = (weights or {}).get("strategy")
        act_strategy = (acts or {}).get("strategy")
        dynamic = bool((acts or {}).get("dynamic"))
        block = (weights or {}).get("block_structure")
        ok = _is_fp8(weights) and _is_fp8(acts) and (
            (strategy == "channel" and dynamic and act_strategy == "token")
            or (strategy == "tensor" and not dynamic and act_strategy == "tensor")
            or (strategy == "tensor" and dynamic and act_strategy == "token")
            or (strategy == "block" and list(block or []) == [ops.BLOCK, ops.BLOCK] and dynamic
                and act_strategy == "group" and acts.get("group_size") == ops.BLOCK)
        )  # fmt: skip
        if not ok:
            raise ValueError(
                f"compressed-tensors: scheme not supported (weights {weights}, input "
                f"activations {acts}); supported: {SUPPORTED}"
            )
        return cls(strategy, not dynamic, list(config.get("ignore") or []))

    def method(self) -> LinearMethod:
        if self.strategy == "block":
            return Fp8BlockLinearMethod(scale_name="weight_scale")
        return Fp8ChannelLinearMethod(self.strategy == "tensor", self.static_input)

    def moe_method(self, module: str) -> FusedMoEMethod | None:
        if self.is_ignored(module):
            return None
        if self.strategy == "block":
            return Fp8MoEMethod("block", "weight_scale")
        return Fp8MoEMethod(self.strategy, static_input=self.static_input)

    def checkpoint_tensors(self, module: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        if self.strategy == "block":
            q, scale = ops.quantize_weight_block(weight)
            return {"weight": q, "weight_scale": scale}
        if self.strategy == "channel":
            q, scale = ops.quantize_weight_channel(weight)
            return {"weight": q, "weight_scale": scale.view(-1, 1)}
        raise NotImplementedError("compressed-tensors: dummy weights are per channel or block")
