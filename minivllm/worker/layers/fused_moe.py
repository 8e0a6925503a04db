"""The routed experts of a sparse MLP, sharded for one rank, and their routing.

Tensor parallelism (the default) gives every rank all experts, each sliced along its
intermediate dimension, as a dense MLP is sliced: each rank's output is a partial sum.
Expert parallelism (`enable_expert_parallel`) gives each rank whole experts, E / tp of them
in order: each rank computes its experts' share for every token, zero for the others, so
its output is a partial sum as well. Either way the sum over the ranks is left to the
norm after the layer.

The expert weights are made, converted after loading and read by the layer's
`quant_method` (quantization/base.py's `FusedMoEMethod`): the model's dtype here, FP8 with
its scales in quantization/fp8_moe.py. Each parameter's `ShardSpec` tells the loader how a
checkpoint tensor of one expert splits along the intermediate dimension.
"""

from __future__ import annotations

import torch
from torch import nn

from minivllm.worker.distributed.parallel_state import TPGroup, divide
from minivllm.worker.layers.quantization.base import PLAIN, FusedMoEMethod, ShardSpec, add_param
from minivllm.worker.layers.weights import Loaded, copy_checked, full, narrow
from minivllm.worker.ops._triton import use_triton
from minivllm.worker.ops.fused_moe import fused_experts, fused_experts_torch
from minivllm.worker.ops.moe_routing import select_experts

# the parts of an expert a checkpoint stores -> the stack that holds them (its parameters
# are named "<stack>_weight", "<stack>_weight_scale", ...)
EXPERT_STACKS = {"gate": "w13", "up": "w13", "down": "w2"}


class UnquantizedMoEMethod(FusedMoEMethod):
    """Experts in the model's dtype."""

    def create_weights(self, layer: nn.Module, dtype: torch.dtype) -> None:
        layer.add_param("w13_weight", layer.w13_shape, dtype)
        layer.add_param("w2_weight", layer.w2_shape, dtype)

    def apply(
        self, layer: nn.Module, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        w13, w2, first = layer.w13_weight, layer.w2_weight, layer.first_expert
        if use_triton(x):
            return fused_experts(x, w13, w2, topk_weights, topk_ids, layer.num_experts, first)
        return fused_experts_torch(x, w13, w2, topk_weights, topk_ids, first)


class FusedMoE(nn.Module):
    """out[t] = sum over t's top-k experts e of weight[t, e] * down_e(silu(gate_e(x)) * up_e(x)),
    with the top-k of softmax(router_logits[t]) (renormalized to sum to 1 when `renormalize`).

    Parameters (`quant_method`'s; unquantized: these two): w13_weight [E_local, 2 * I_local,
    H] (each expert's gate rows, then its up rows) and w2_weight [E_local, H, I_local].
    Checkpoint tensors arrive per expert with shard_id (global expert id, "gate" | "up" |
    "down"); another rank's experts are skipped.
    """

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        tp: TPGroup,
        renormalize: bool,
        expert_parallel: bool = False,
        params_dtype: torch.dtype | None = None,
        quant_method: FusedMoEMethod | None = None,
    ) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok must be in 1..{num_experts}, got {top_k}")
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        # whether each expert's intermediate dimension is split over the ranks
        self.split = not expert_parallel and tp.size > 1
        if expert_parallel:
            self.num_local_experts = divide(num_experts, tp.size)
            self.first_expert = tp.rank * self.num_local_experts
            self.inter, self.inter_rank = intermediate_size, 0
        else:
            self.num_local_experts, self.first_expert = num_experts, 0
            self.inter, self.inter_rank = divide(intermediate_size, tp.size), tp.rank
        local, self.hidden_size = self.num_local_experts, hidden_size
        self.w13_shape = (local, 2 * self.inter, hidden_size)
        self.w2_shape = (local, hidden_size, self.inter)
        self.quant_method = quant_method or UnquantizedMoEMethod()
        self.quant_method.create_weights(self, params_dtype or torch.get_default_dtype())

    def add_param(
        self,
        name: str,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        spec: ShardSpec = PLAIN,
        fill: float | None = None,
    ) -> nn.Parameter:
        """A parameter of the stack its name starts with (w13_: gate and up, w2_: down)."""
        param = add_param(self, name, shape, dtype, spec, fill)
        param.stack = name.split("_", 1)[0]
        parts = [part for part, stack in EXPERT_STACKS.items() if stack == param.stack]
        # every rank expects every expert's parts (those of other ranks are read past)
        param.shards = {(e, part) for e in range(self.num_experts) for part in parts}
        return param

    def weight_loader(self, param: nn.Parameter, loaded: Loaded, shard_id: object = None) -> None:
        """Copy this rank's slice of one expert's gate [I, H], up [I, H] or down [H, I] (or
        of a scale of one, as the parameter's `ShardSpec` says)."""
        if not (isinstance(shard_id, tuple) and len(shard_id) == 2):
            raise ValueError(f"shard_id must be (expert, part), got {shard_id!r}")
        expert, part = shard_id
        if not (isinstance(expert, int) and 0 <= expert < self.num_experts):
            raise ValueError(f"expert {expert!r} is not in 0..{self.num_experts - 1}")
        if EXPERT_STACKS.get(part) != getattr(param, "stack", None):
            raise ValueError(f"part {part!r} does not belong to this parameter")
        spec: ShardSpec = param.shard_spec
        if spec.max_of_shards:  # one static scale: the max over all experts, on every rank
            value = full(loaded).to(param.device, param.dtype).reshape(param.shape)
            param.data.copy_(torch.maximum(param.data, value))
            return
        local = expert - self.first_expert
        if not 0 <= local < self.num_local_experts:
            return  # another rank's expert
        dst = param.data[local]
        if part != "down":
            dst, loaded = self._gate_up_rows(dst, loaded, part == "up", spec)
        elif spec.input_dim is not None:
            loaded = self._intermediate_columns(loaded, spec)
        if spec.broadcast_rows:  # a per-tensor scale on each row
            dst.copy_(full(loaded).reshape(()).expand(dst.shape))
            return
        copy_checked(dst, full(loaded))

    def _gate_up_rows(
        self, dst: torch.Tensor, loaded: Loaded, up: bool, spec: ShardSpec
    ) -> tuple[torch.Tensor, Loaded]:
        """(gate's or up's rows of one expert's w13 parameter, this rank's rows of the
        checkpoint tensor): rows of the intermediate dimension, in units of output_div rows,
        or per weight row from per-block rows (row_block)."""
        n, start = self.inter, self.inter_rank * self.inter
        row0 = n if up else 0
        if spec.broadcast_rows:
            return dst.narrow(0, row0, n), loaded
        if spec.row_block > 1:  # a scale row per weight row, from the checkpoint's block rows
            b = spec.row_block
            first, end = start // b, -(-(start + n) // b)
            rows = full(narrow(loaded, 0, first, end - first)).repeat_interleave(b, 0)
            return dst.narrow(0, row0, n), rows.narrow(0, start - first * b, n)
        div = spec.output_div
        if n % div:
            raise ValueError(f"{n} intermediate rows per rank are not whole blocks of {div}")
        return dst.narrow(0, row0 // div, n // div), narrow(loaded, 0, start // div, n // div)

    def _intermediate_columns(self, loaded: Loaded, spec: ShardSpec) -> Loaded:
        """This rank's columns of down's intermediate dimension, in units of input_div."""
        n, start, div = self.inter, self.inter_rank * self.inter, spec.input_div
        if self.split and n % div:
            raise ValueError(
                f"{n} intermediate columns per rank are not whole groups of {div}: this "
                "tensor-parallel split cuts the experts' scale blocks (enable_expert_parallel "
                "keeps experts whole)"
            )
        return narrow(loaded, spec.input_dim, start // div, -(-n // div))

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """x [T, H] (whole on every rank), router_logits [T, E] -> this rank's partial sum."""
        topk_weights, topk_ids = select_experts(router_logits, self.top_k, self.renormalize)
        return self.apply_experts(x, topk_weights, topk_ids)

    def apply_experts(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        """This rank's experts on the routed tokens: the Triton kernels where Triton runs,
        else the torch loop over experts (the quantization method's)."""
        return self.quant_method.apply(self, x, topk_weights, topk_ids)
