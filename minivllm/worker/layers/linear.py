"""Tensor-parallel linear layers (Megatron style).

Column-parallel layers split the output features across ranks and need no communication;
row-parallel layers split the input features, so each rank's product is a partial sum to
all-reduce. A column-parallel layer followed by a row-parallel one (qkv -> o, gate_up -> down)
thus costs one all-reduce, which a decoder leaves to the norm after it (`reduce_results`).
Each parameter carries a `weight_loader(param, loaded, shard_id=None)` that copies this
rank's slice of a checkpoint tensor into it, as the parameter's `ShardSpec` says (a quantized
weight's packed ints and scales split along with the weight's rows or columns). The stacked
layers (q/k/v, gate/up) take one checkpoint tensor per shard, or with shard_id None one that
holds them all, fused as Phi-3 stores them: split into its shards first, so each rank still
takes its own heads and its part of gate and of up, not a contiguous slice of the fused rows.
"""

from __future__ import annotations

import torch
from torch import nn

from minivllm.worker.distributed.parallel_state import TPGroup, divide
from minivllm.worker.layers.quantization.base import (
    LinearMethod,
    LinearShape,
    QuantizationConfig,
    ShardSpec,
    UnquantizedLinearMethod,
    add_param,
)
from minivllm.worker.layers.weights import (
    Loaded,
    copy_checked,
    default_weight_loader,
    full,
    lazy_rows,
    narrow,
    shape_of,
)
from minivllm.worker.ops.gemv import linear


class _SplitLinear(nn.Module):
    """y = x W^T + b with W [output_size, input_size] split across the ranks along
    `split_dim` (0: output rows, 1: input columns); each rank loads its slice. The weight's
    parameters are the quantization method's (`quant_method`: a plain W without one)."""

    split_dim = 0

    def __init__(
        self,
        input_size: int,
        output_size: int,
        tp: TPGroup,
        bias: bool = False,
        params_dtype: torch.dtype | None = None,
        quant_config: QuantizationConfig | None = None,
        checkpoint_names: list[str] | None = None,
    ) -> None:
        super().__init__()
        self.tp = tp
        self._output_size = output_size
        dtype = params_dtype or torch.get_default_dtype()
        sizes = [output_size, input_size]
        sizes[self.split_dim] = divide(sizes[self.split_dim], tp.size)
        self.shape = LinearShape(
            input_size, output_size, sizes[1], sizes[0], self.split_dim == 1,
            self._output_shards() if self.split_dim == 0 else (output_size,),
        )  # fmt: skip
        self.quant_method: LinearMethod = (
            quant_config.linear_method(checkpoint_names or [])
            if quant_config is not None
            else UnquantizedLinearMethod()
        )
        self.quant_method.create_weights(self, self.shape, dtype)
        # output rows split: so is the bias; input columns split: every rank holds all of the
        # bias, added once (by rank 0)
        spec = ShardSpec(0, None) if self.split_dim == 0 else ShardSpec(None, None)
        self.bias = add_param(self, "bias", (sizes[0],), dtype, spec) if bias else None

    def _output_shards(self) -> tuple[int, ...]:
        """This rank's rows of each stacked output."""
        return (divide(self._output_size, self.tp.size),)

    def _output_range(self, shard_id: object) -> tuple[int, int, int]:
        """(first row in this rank's output, first row in the checkpoint tensor, rows) of the
        checkpoint tensor `shard_id` names."""
        if shard_id is not None:
            raise ValueError(f"{type(self).__name__} is not stacked, got shard_id {shard_id!r}")
        if self.split_dim == 1:
            return 0, 0, self.shape.output_size
        rows = self.shape.output_per_rank
        return 0, self.tp.rank * rows, rows

    def _fused_shards(self) -> list[tuple] | None:
        """[(shard_id, rows in the checkpoint), ...] of a stacked layer, else None."""
        return None

    def weight_loader(self, param: nn.Parameter, loaded: Loaded, shard_id: object = None) -> None:
        """Copy this rank's part of a checkpoint tensor into `param`, as its `ShardSpec` says."""
        spec: ShardSpec = getattr(param, "shard_spec", ShardSpec())
        shards = self._fused_shards()
        if shard_id is None and shards is not None:
            if spec.output_dim != 0 or spec.output_div != 1 or spec.row_block != 1:
                raise ValueError("a tensor fusing stacked shards is supported unquantized only")
            _load_fused(self, param, loaded, shards)
            return
        dst_row, src_row, rows = self._output_range(shard_id)
        dst, src = param.data, loaded
        if spec.max_of_shards:
            value = full(loaded).to(dst.device, dst.dtype).reshape(dst.shape)
            dst.copy_(torch.maximum(dst, value) if shard_id is not None else value)
            return
        if spec.output_dim is not None and spec.row_block > 1:
            d, b = spec.output_dim, spec.row_block
            first, end = src_row // b, -(-(src_row + rows) // b)
            blocks = narrow(src, d, first, end - first)
            src = blocks.repeat_interleave(b, d).narrow(d, src_row - first * b, rows)
            dst = dst.narrow(d, dst_row, rows)
        elif spec.output_dim is not None:
            d, div = spec.output_dim, spec.output_div
            length = -(-rows // div)
            if dst_row % div or src_row % div:
                raise ValueError(
                    f"{rows} output rows at {dst_row} (checkpoint row {src_row}) do not start a "
                    f"block of {div}: this tensor-parallel split cuts its scale blocks"
                )
            dst = dst.narrow(d, dst_row // div, length)
            if spec.broadcast_rows:
                dst.copy_(full(loaded).reshape(()).expand(dst.shape))
                return
            src = narrow(src, d, src_row // div, length)
        if spec.input_dim is not None and self.shape.input_split and self.tp.size > 1:
            d, div, cols = spec.input_dim, spec.input_div, self.shape.input_per_rank
            if cols % div:
                raise ValueError(f"{cols} input columns per rank are not whole groups of {div}")
            src = narrow(src, d, self.tp.rank * cols // div, cols // div)
        copy_checked(dst, full(src))

    @property
    def plain_weight(self) -> torch.Tensor | None:
        """The 16-bit W [N, K] the fused ops' GEMV may read; None for a quantized weight."""
        return self.quant_method.plain_weight(self)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.quant_method.apply(self, x, bias)


class ColumnParallelLinear(_SplitLinear):
    """y = x W^T + b with W's output rows split across ranks: each rank returns its part."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matmul (gate and up): per rank, each output's
    shard is laid out one after another. Checkpoint tensors come with shard_id = 0, 1, ...,
    or all outputs in one (shard_id None: Phi-3's gate_up_proj)."""

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        tp: TPGroup,
        bias: bool = False,
        params_dtype: torch.dtype | None = None,
        quant_config: QuantizationConfig | None = None,
        checkpoint_names: list[str] | None = None,
    ) -> None:
        self.output_sizes = list(output_sizes)
        super().__init__(
            input_size, sum(output_sizes), tp, bias, params_dtype, quant_config, checkpoint_names
        )

    def _output_shards(self) -> tuple[int, ...]:
        return tuple(divide(s, self.tp.size) for s in self.output_sizes)

    def _fused_shards(self) -> list[tuple] | None:
        return list(enumerate(self.output_sizes))

    def _output_range(self, shard_id: object) -> tuple[int, int, int]:
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(
                f"shard_id must be in 0..{len(self.output_sizes) - 1}, got {shard_id!r}"
            )
        sizes = [divide(s, self.tp.size) for s in self.output_sizes]
        rows = sizes[shard_id]
        return sum(sizes[:shard_id]), self.tp.rank * rows, rows


class QKVParallelLinear(ColumnParallelLinear):
    """The q, k and v projections in one matmul, sharded by attention head.

    Each rank holds num_heads / tp query heads and num_kv_heads / tp key/value heads; when
    tp > num_kv_heads every kv head is replicated on tp / num_kv_heads consecutive ranks.
    Checkpoint tensors come with shard_id "q", "k" or "v", or all three in one (shard_id
    None: Phi-3's qkv_proj).
    """

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        tp: TPGroup,
        bias: bool = False,
        params_dtype: torch.dtype | None = None,
        quant_config: QuantizationConfig | None = None,
        checkpoint_names: list[str] | None = None,
    ) -> None:
        self.head_dim = head_dim
        self.total_num_heads, self.total_num_kv_heads = num_heads, num_kv_heads
        self.num_heads = divide(num_heads, tp.size)
        if tp.size >= num_kv_heads:
            self.num_kv_heads = 1
            self.num_kv_replicas = divide(tp.size, num_kv_heads)
        else:
            self.num_kv_heads = divide(num_kv_heads, tp.size)
            self.num_kv_replicas = 1
        per_rank = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        super().__init__(
            hidden_size, per_rank * tp.size, tp, bias, params_dtype, quant_config, checkpoint_names
        )

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def _output_shards(self) -> tuple[int, ...]:
        return (self.q_size, self.kv_size, self.kv_size)

    def _fused_shards(self) -> list[tuple] | None:
        q, kv = self.total_num_heads * self.head_dim, self.total_num_kv_heads * self.head_dim
        return [("q", q), ("k", kv), ("v", kv)]

    def _output_range(self, shard_id: object) -> tuple[int, int, int]:
        if shard_id == "q":
            return 0, self.tp.rank * self.q_size, self.q_size
        if shard_id in ("k", "v"):
            offset = self.q_size + (self.kv_size if shard_id == "v" else 0)
            src_rank = self.tp.rank // self.num_kv_replicas
            return offset, src_rank * self.kv_size, self.kv_size
        raise ValueError(f"shard_id must be 'q', 'k' or 'v', got {shard_id!r}")


def _load_fused(
    layer: _SplitLinear, param: nn.Parameter, loaded: Loaded, shards: list[tuple]
) -> None:
    """Load a checkpoint tensor that holds every shard of a stacked layer, one after another
    in its rows, [(shard_id, rows), ...], by loading each shard's rows."""
    total = sum(n for _, n in shards)
    if shape_of(loaded)[0] != total:
        raise ValueError(
            f"fused checkpoint shape {shape_of(loaded)} has {shape_of(loaded)[0]} rows, "
            f"expected {total} ({', '.join(f'{sid}: {n}' for sid, n in shards)})"
        )
    start = 0
    for shard_id, n in shards:
        layer.weight_loader(param, lazy_rows(loaded, start, n), shard_id)
        start += n


class RowParallelLinear(_SplitLinear):
    """y = x W^T + b with W's input columns split across ranks; x arrives already split (the
    output of a column-parallel layer). Each rank's product is a partial sum (rank 0's
    carrying the bias), summed over the ranks here, or with `reduce_results=False` returned as
    it is, for the op after it to sum (a decoder's next norm: `fused.all_reduce_add_rms_norm`)."""

    split_dim = 1

    def __init__(
        self,
        input_size: int,
        output_size: int,
        tp: TPGroup,
        bias: bool = False,
        params_dtype: torch.dtype | None = None,
        reduce_results: bool = True,
        quant_config: QuantizationConfig | None = None,
        checkpoint_names: list[str] | None = None,
    ) -> None:
        super().__init__(
            input_size, output_size, tp, bias, params_dtype, quant_config, checkpoint_names
        )
        self.reduce_results = reduce_results and tp.size > 1

    @property
    def rank_bias(self) -> torch.Tensor | None:
        """The bias this rank adds: rank 0 alone, so that the partial sums add up to one."""
        return self.bias if self.tp.rank == 0 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x, self.rank_bias)
        return self.tp.all_reduce(y) if self.reduce_results else y


class ReplicatedLinear(nn.Module):
    """y = x W^T with all of W on every rank (a mixture-of-experts router): no sharding, no
    communication."""

    def __init__(
        self, input_size: int, output_size: int, params_dtype: torch.dtype | None = None
    ) -> None:
        super().__init__()
        # torch.empty: the loader (or dummy init) fills every element
        self.weight = nn.Parameter(
            torch.empty(output_size, input_size, dtype=params_dtype), requires_grad=False
        )
        self.weight.weight_loader = default_weight_loader

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight)
