"""AWQ checkpoints (AutoAWQ's GEMM layout, `quant_method: awq`, `version: gemm`), 4-bit
weights with a scale and a zero point per group of K (`group_size`, 128 usually):

- `qweight` int32 [K, N/8]: 8 output features per word, in AWQ's interleaved order: the
  word's nibble i (bits 4i..4i+3) holds feature `AWQ_ORDER[i]` of its 8;
- `qzeros` int32 [K/group, N/8], packed the same way; `scales` float16 [K/group, N];
- w(n, k) = (q(k, n) - zero(k // group, n)) * scale(k // group, n).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from minivllm.worker.layers.quantization.base import (
    LinearMethod,
    LinearShape,
    QuantizationConfig,
    ShardSpec,
    add_param,
)
from minivllm.worker.layers.quantization.int4 import (
    NIBBLES,
    W4LinearMethod,
    pack_words,
    quantize_int4,
    unpack_words,
)
from minivllm.worker.ops import w4a16 as ops

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a word holds feature AWQ_ORDER[i]
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # feature j sits in nibble AWQ_REVERSE_ORDER[j]


def unpack_awq(words: torch.Tensor) -> torch.Tensor:
    """int32 [R, N/8] in AWQ's order -> int32 [R, N] of 4-bit values, features in order."""
    nibbles = unpack_words(words, 1).unflatten(1, (-1, NIBBLES))
    return nibbles[:, :, list(AWQ_REVERSE_ORDER)].flatten(1)


def pack_awq(values: torch.Tensor) -> torch.Tensor:
    """int [R, N] of 4-bit values -> int32 [R, N/8] in AWQ's order."""
    grouped = values.unflatten(1, (-1, NIBBLES))[:, :, list(AWQ_ORDER)]
    return pack_words(grouped.flatten(1), 1)


def awq_checkpoint_tensors(weight: torch.Tensor, group: int) -> dict[str, torch.Tensor]:
    """A float W [N, K] as an AWQ checkpoint stores it (zero point, as AutoAWQ's default)."""
    q, scales, zeros = quantize_int4(weight, group, symmetric=False)
    return {
        "qweight": pack_awq(q.T),
        "qzeros": pack_awq(zeros.T),
        "scales": scales.T.contiguous(),
    }


class AwqLinearMethod(W4LinearMethod):
    def create_weights(self, layer: nn.Module, shape: LinearShape, dtype: torch.dtype) -> None:
        n, k = shape.output_per_rank, shape.input_per_rank
        group = self.group(shape.input_size)
        if n % NIBBLES or k % group:
            raise ValueError(
                f"awq: {n} output features per rank must be a multiple of 8 and {k} input "
                f"features per rank a multiple of group_size {group}"
            )
        add_param(layer, "qweight", (k, n // NIBBLES), torch.int32, ShardSpec(1, 0, NIBBLES, 1))
        packed_groups = ShardSpec(1, 0, NIBBLES, group)
        add_param(layer, "qzeros", (k // group, n // NIBBLES), torch.int32, packed_groups)
        add_param(layer, "scales", (k // group, n), torch.float16, ShardSpec(1, 0, 1, group))

    def to_kernel_layout(self, layer: nn.Module) -> ops.W4Weights:
        q = unpack_awq(layer.qweight.data)  # [K, N]
        zeros = unpack_awq(layer.qzeros.data)  # [groups, N]
        k = q.shape[0]
        return ops.W4Weights(
            ops.pack_along_k(q.T), layer.scales.data.T, zeros.T.to(torch.uint8),
            k // zeros.shape[0],
        )  # fmt: skip


class AwqConfig(QuantizationConfig):
    name = "awq"

    def __init__(self, group_size: int, ignored: list[str] | None = None) -> None:
        super().__init__(ignored)
        self.group_size = group_size

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> AwqConfig:
        bits = config.get("bits", config.get("w_bit"))
        group = config.get("group_size", config.get("q_group_size"))
        version = str(config.get("version", "gemm")).lower()
        zero_point = config.get("zero_point", True)
        if bits != 4 or version != "gemm" or not zero_point:
            raise ValueError(
                f"awq: bits={bits}, version={version!r}, zero_point={zero_point} is not "
                "supported; supported: 4 bits, version 'gemm', zero_point true"
            )
        if not isinstance(group, int) or group < 8 or group & (group - 1):
            raise ValueError(f"awq: group_size must be a power of two >= 8, got {group!r}")
        return cls(group, config.get("modules_to_not_convert"))

    def method(self) -> LinearMethod:
        return AwqLinearMethod(self.group_size)

    def checkpoint_tensors(self, module: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        return awq_checkpoint_tensors(weight, self.group_size)
