"""GPTQ checkpoints (AutoGPTQ / GPTQModel, `quant_method: gptq`), 4 bits, a scale and a zero
point per group of K (`group_size`; -1: one group):

- `qweight` int32 [K/8, N]: 8 consecutive input features per word, the first lowest;
- `qzeros` int32 [groups, N/8]: 8 consecutive output features per word; the stored value is
  the zero point minus one (`checkpoint_format: gptq`; `gptq_v2` stores it as it is);
- `scales` float16 [groups, N]; `g_idx` int32 [K]: each input feature's group;
- w(n, k) = (q(k, n) - zero(g_idx[k], n)) * scale(g_idx[k], n).

With `desc_act` (act-order) the groups are not runs of K: the rows are sorted by group at
load and the kernels read x in that order (`perm`); under a row-parallel split a rank's rows
may start and end groups anywhere, so that rank keeps every group's scales and reads each
row's group from `g_idx` (vLLM leaves exllama aside for such layers too).
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


def gptq_checkpoint_tensors(
    weight: torch.Tensor, group: int, zero_offset: int = 1
) -> dict[str, torch.Tensor]:
    """A float W [N, K] as a GPTQ checkpoint stores it: symmetric (zero 8, stored as 7 in
    the `gptq` format), no act-order."""
    q, scales, zeros = quantize_int4(weight, group, symmetric=True)
    k = weight.shape[1]
    return {
        "qweight": pack_words(q.T, 0),
        "qzeros": pack_words(zeros.T - zero_offset, 1),
        "scales": scales.T.contiguous(),
        "g_idx": (torch.arange(k, device=weight.device) // group).to(torch.int32),
    }


class GptqLinearMethod(W4LinearMethod):
    def __init__(self, group_size: int, desc_act: bool, zero_offset: int) -> None:
        super().__init__(group_size)
        self.desc_act, self.zero_offset = desc_act, zero_offset

    def create_weights(self, layer: nn.Module, shape: LinearShape, dtype: torch.dtype) -> None:
        n, k = shape.output_per_rank, shape.input_per_rank
        group = self.group(shape.input_size)
        # act-order under a row-parallel split: every rank keeps all groups' scales
        whole_groups = self.desc_act and shape.input_split and group < shape.input_size
        groups_dim = None if whole_groups or group == shape.input_size else 0
        groups = shape.input_size // group if groups_dim is None else k // group
        if n % NIBBLES or k % NIBBLES or (groups_dim is not None and k % group):
            raise ValueError(
                f"gptq: {n} output and {k} input features per rank must be multiples of 8, "
                f"and the input features whole groups of {group}"
            )
        add_param(layer, "qweight", (k // NIBBLES, n), torch.int32, ShardSpec(1, 0, 1, NIBBLES))
        zeros_spec = ShardSpec(1, groups_dim, NIBBLES, group)
        add_param(layer, "qzeros", (groups, n // NIBBLES), torch.int32, zeros_spec)
        add_param(layer, "scales", (groups, n), torch.float16, ShardSpec(1, groups_dim, 1, group))
        add_param(layer, "g_idx", (k,), torch.int32, ShardSpec(None, 0))
        # the first group of this rank's scales, in g_idx's numbering
        split_groups = shape.input_split and groups_dim is not None
        layer.group_offset = layer.tp.rank * k // group if split_groups else 0

    def to_kernel_layout(self, layer: nn.Module) -> ops.W4Weights:
        q = unpack_words(layer.qweight.data, 0)  # [K, N]
        zeros = unpack_words(layer.qzeros.data, 1) + self.zero_offset  # [groups, N]
        k, group = q.shape[0], self.group(layer.shape.input_size)
        g_idx = layer.g_idx.data.long() - layer.group_offset
        regular = torch.arange(k, device=q.device) // group
        perm = None
        if not torch.equal(g_idx, regular):  # act-order: sort the rows by group
            perm = torch.argsort(g_idx, stable=True)
            q, g_idx = q[perm], g_idx[perm]
        keep_g_idx = not torch.equal(g_idx, regular)
        return ops.W4Weights(
            ops.pack_along_k(q.T), layer.scales.data.T, zeros.T.to(torch.uint8), group,
            perm, g_idx.to(torch.int32) if keep_g_idx else None,
        )  # fmt: skip


class GptqConfig(QuantizationConfig):
    name = "gptq"

    def __init__(self, group_size: int, desc_act: bool, zero_offset: int) -> None:
        super().__init__()
        self.group_size, self.desc_act, self.zero_offset = group_size, desc_act, zero_offset

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> GptqConfig:
        bits, group = config.get("bits"), config.get("group_size", 128)
        fmt = config.get("checkpoint_format", "gptq")
        if bits != 4:
            raise ValueError(f"gptq: bits={bits} is not supported; supported: 4")
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"gptq: checkpoint_format {fmt!r} is not supported; 'gptq', 'gptq_v2'")
        if group != -1 and (not isinstance(group, int) or group < 8 or group & (group - 1)):
            raise ValueError(f"gptq: group_size must be -1 or a power of two >= 8, got {group!r}")
        if config.get("dynamic"):
            raise ValueError("gptq: per-module 'dynamic' overrides are not supported")
        return cls(group, bool(config.get("desc_act", False)), 1 if fmt == "gptq" else 0)

    def method(self) -> LinearMethod:
        return GptqLinearMethod(self.group_size, self.desc_act, self.zero_offset)

    def checkpoint_tensors(self, module: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        group = weight.shape[1] if self.group_size == -1 else self.group_size
        return gptq_checkpoint_tensors(weight, group, self.zero_offset)
