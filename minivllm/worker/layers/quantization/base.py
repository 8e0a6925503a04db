"""What a quantization format gives the linear layers, as vLLM's `QuantizationConfig` and
`LinearMethodBase`.

A `QuantizationConfig` is read from config.json's `quantization_config` (or made for online
quantization) and picks each linear layer's `LinearMethod`; the method creates the layer's
parameters in the checkpoint's layout, each tagged with how it splits across the
tensor-parallel ranks (`ShardSpec`, read by the layers' weight loaders in linear.py), then,
once loaded, converts them to what its kernels read (`process_weights_after_loading`),
and computes the layer (`apply`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from minivllm.worker.ops.gemv import linear


@dataclass(frozen=True)
class ShardSpec:
    """How a linear layer's parameter relates to the layer's features: which of its dims
    indexes output features and which input features (None: neither), each in units of
    `*_div` features (a packing factor, a group or block size). `broadcast_rows`: the
    checkpoint has one value per shard (a per-tensor scale), copied onto every output row
    of the shard. `max_of_shards`: one value for the layer, the max over the stacked shards'
    (a static activation scale shared by q, k and v). `row_block`: see below."""

    output_dim: int | None = 0
    input_dim: int | None = 1
    output_div: int = 1
    input_div: int = 1
    broadcast_rows: bool = False
    max_of_shards: bool = False
    # the checkpoint holds one row per `row_block` output rows, the parameter one per row
    # (block scales of a layer whose shards do not start on a block)
    row_block: int = 1


PLAIN = ShardSpec()  # W [N, K]


def add_param(
    layer: nn.Module,
    name: str,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    spec: ShardSpec = PLAIN,
    fill: float | None = None,
) -> nn.Parameter:
    """Register an uninitialized (or `fill`ed) parameter whose loader is the layer's."""
    data = torch.empty(shape, dtype=dtype) if fill is None else torch.full(shape, fill, dtype=dtype)
    param = nn.Parameter(data, requires_grad=False)
    param.shard_spec = spec
    param.weight_loader = layer.weight_loader
    layer.register_parameter(name, param)
    return param


def replace_param(layer: nn.Module, name: str, data: torch.Tensor) -> None:
    """Swap a loaded parameter for its converted form (no loader: it is not loaded again)."""
    if name in layer._parameters:
        delattr(layer, name)
    layer.register_parameter(name, nn.Parameter(data, requires_grad=False))


@dataclass(frozen=True)
class LinearShape:
    """A linear layer's size, whole and on this rank."""

    input_size: int  # K
    output_size: int  # N (all stacked outputs)
    input_per_rank: int
    output_per_rank: int
    input_split: bool  # row-parallel: each rank holds a slice of K
    output_shards: tuple[int, ...]  # this rank's rows of each stacked output (q, k, v; ...)


class LinearMethod:
    """How one linear layer holds and multiplies its weight."""

    def create_weights(self, layer: nn.Module, shape: LinearShape, dtype: torch.dtype) -> None:
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Convert the loaded checkpoint tensors to the kernels' layout (default: nothing)."""

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x [T, K] -> x W^T + bias [T, N] in x's dtype."""
        raise NotImplementedError

    def plain_weight(self, layer: nn.Module) -> torch.Tensor | None:
        """The 16-bit W [N, K] that the fused GEMV prologues read, or None (quantized)."""
        return None


class UnquantizedLinearMethod(LinearMethod):
    def create_weights(self, layer: nn.Module, shape: LinearShape, dtype: torch.dtype) -> None:
        add_param(layer, "weight", (shape.output_per_rank, shape.input_per_rank), dtype)

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        return linear(x, layer.weight, bias)

    def plain_weight(self, layer: nn.Module) -> torch.Tensor | None:
        return layer.weight


class FusedMoEMethod:
    """How a mixture of experts' layer (`FusedMoE`, layers/fused_moe.py) holds and multiplies
    its experts: the same three steps as a `LinearMethod`, on the stacked expert tensors
    w13 [E, 2I, H] and w2 [E, H, I] and their scales, each parameter with a `ShardSpec` read
    per expert (gate and up rows: its output dim; down's columns: its input dim)."""

    def create_weights(self, layer: nn.Module, dtype: torch.dtype) -> None:
        raise NotImplementedError

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Convert the loaded checkpoint tensors to the kernels' layout (default: nothing)."""

    def apply(
        self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        """x [T, H] and its routing -> this rank's experts' sum [T, H]."""
        raise NotImplementedError


class QuantizationConfig:
    """One checkpoint's (or online) quantization: which layers, which method."""

    name: ClassVar[str]

    def __init__(self, ignored: list[str] | None = None) -> None:
        self.ignored = list(ignored or [])

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> QuantizationConfig:
        raise NotImplementedError

    def method(self) -> LinearMethod:
        """The method of a layer this format quantizes."""
        raise NotImplementedError

    def linear_method(self, checkpoint_names: list[str]) -> LinearMethod:
        """The method of the linear layer that holds these checkpoint modules (one, or the
        stacked q/k/v or gate/up); the format's skip list leaves some unquantized."""
        skipped = [self.is_ignored(name) for name in checkpoint_names]
        if skipped and all(skipped):
            return UnquantizedLinearMethod()
        if any(skipped):
            raise ValueError(
                f"{self.name}: {checkpoint_names} share one matmul, so must all be quantized "
                "or all not, but the skip list names only some"
            )
        return self.method()

    def moe_method(self, module: str) -> FusedMoEMethod | None:
        """The method of the experts of mixture-of-experts layer `module`; None: unquantized
        (the skip list names them). A format without one refuses quantized experts."""
        if self.is_ignored(module):
            return None
        raise ValueError(
            f"{self.name}: quantized experts ({module}) are not supported in this format; "
            "quantized mixtures of experts load from fp8 and compressed-tensors (FP8) checkpoints"
        )

    def is_ignored(self, module: str) -> bool:
        """Entries are module names, suffixes of them, or (compressed-tensors) 're:' regexes."""
        for entry in self.ignored:
            if entry.startswith("re:"):
                if re.match(entry[3:], module):
                    return True
            elif module == entry or module.endswith("." + entry) or entry in module.split("."):
                return True
        return False

    def checkpoint_tensors(self, module: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        """How a checkpoint of this format stores the float weight of linear module `module`
        (for dummy weights): suffix ("weight", "weight_scale_inv", ...) -> tensor."""
        raise NotImplementedError(f"{self.name} has no dummy checkpoint layout")
