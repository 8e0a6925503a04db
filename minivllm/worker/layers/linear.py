"""Tensor-parallel linear layers (Megatron style).

Column-parallel layers split the output features across ranks and need no communication;
row-parallel layers split the input features, so each rank's product is a partial sum to
all-reduce. A column-parallel layer followed by a row-parallel one (qkv -> o, gate_up -> down)
thus costs one all-reduce, which a decoder leaves to the norm after it (`reduce_results`).
Each parameter carries a `weight_loader(param, loaded, shard_id=None)` that copies this
rank's slice of a checkpoint tensor into it. The stacked layers (q/k/v, gate/up) take one
checkpoint tensor per shard, or with shard_id None one that holds them all, fused as Phi-3
stores them: split into its shards first, so each rank still takes its own heads and its
part of gate and of up, not a contiguous slice of the fused rows.
"""

from __future__ import annotations

import torch
from torch import nn

from minivllm.worker.distributed.parallel_state import TPGroup, divide
from minivllm.worker.layers.weights import (
    Loaded,
    copy_checked,
    default_weight_loader,
    lazy_rows,
    narrow,
    shape_of,
)
from minivllm.worker.ops.gemv import linear


def _param(*shape: int, dtype: torch.dtype | None, loader) -> nn.Parameter:
    # torch.empty: the loader (or dummy init) fills every element; no wasted random init
    p = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
    p.weight_loader = loader
    return p


class _SplitLinear(nn.Module):
    """y = x W^T + b with W [output_size, input_size] split across the ranks along
    `split_dim` (0: output rows, 1: input columns); each rank loads its slice."""

    split_dim = 0

    def __init__(
        self,
        input_size: int,
        output_size: int,
        tp: TPGroup,
        bias: bool = False,
        params_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.tp = tp
        shape = [output_size, input_size]
        shape[self.split_dim] = divide(shape[self.split_dim], tp.size)
        self.weight = _param(*shape, dtype=params_dtype, loader=self.weight_loader)
        # output rows split: so is the bias; input columns split: every rank holds all of the
        # bias, added once (by rank 0)
        bias_loader = self.weight_loader if self.split_dim == 0 else default_weight_loader
        self.bias = _param(shape[0], dtype=params_dtype, loader=bias_loader) if bias else None

    def weight_loader(self, param: nn.Parameter, loaded: Loaded, shard_id: object = None) -> None:
        if shard_id is not None:
            raise ValueError(f"{type(self).__name__} is not stacked, got shard_id {shard_id!r}")
        n = param.shape[self.split_dim]
        copy_checked(param.data, narrow(loaded, self.split_dim, self.tp.rank * n, n))


class ColumnParallelLinear(_SplitLinear):
    """y = x W^T + b with W's output rows split across ranks: each rank returns its part."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


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
    ) -> None:
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), tp, bias, params_dtype)

    def weight_loader(self, param: nn.Parameter, loaded: Loaded, shard_id: object = None) -> None:
        if shard_id is None:
            _load_fused(self, param, loaded, list(enumerate(self.output_sizes)))
            return
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(
                f"shard_id must be in 0..{len(self.output_sizes) - 1}, got {shard_id!r}"
            )
        sizes = [divide(s, self.tp.size) for s in self.output_sizes]
        offset, rows = sum(sizes[:shard_id]), sizes[shard_id]
        copy_checked(
            param.data.narrow(0, offset, rows), narrow(loaded, 0, self.tp.rank * rows, rows)
        )


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
        super().__init__(hidden_size, per_rank * tp.size, tp, bias, params_dtype)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def weight_loader(self, param: nn.Parameter, loaded: Loaded, shard_id: object = None) -> None:
        if shard_id is None:
            q, kv = self.total_num_heads * self.head_dim, self.total_num_kv_heads * self.head_dim
            _load_fused(self, param, loaded, [("q", q), ("k", kv), ("v", kv)])
            return
        if shard_id == "q":
            offset, rows, src_rank = 0, self.q_size, self.tp.rank
        elif shard_id in ("k", "v"):
            offset = self.q_size + (self.kv_size if shard_id == "v" else 0)
            rows, src_rank = self.kv_size, self.tp.rank // self.num_kv_replicas
        else:
            raise ValueError(f"shard_id must be 'q', 'k' or 'v', got {shard_id!r}")
        copy_checked(param.data.narrow(0, offset, rows), narrow(loaded, 0, src_rank * rows, rows))


def _load_fused(
    layer: ColumnParallelLinear, param: nn.Parameter, loaded: Loaded, shards: list[tuple]
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
    ) -> None:
        super().__init__(input_size, output_size, tp, bias, params_dtype)
        self.reduce_results = reduce_results and tp.size > 1

    @property
    def rank_bias(self) -> torch.Tensor | None:
        """The bias this rank adds: rank 0 alone, so that the partial sums add up to one."""
        return self.bias if self.tp.rank == 0 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight, self.rank_bias)
        return self.tp.all_reduce(y) if self.reduce_results else y


class ReplicatedLinear(nn.Module):
    """y = x W^T with all of W on every rank (a mixture-of-experts router): no sharding, no
    communication."""

    def __init__(
        self, input_size: int, output_size: int, params_dtype: torch.dtype | None = None
    ) -> None:
        super().__init__()
        self.weight = _param(
            output_size, input_size, dtype=params_dtype, loader=default_weight_loader
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight)
