"""The routed experts of a sparse MLP, sharded for one rank, and their routing.

Tensor parallelism (the default) gives every rank all experts, each sliced along its
intermediate dimension, as a dense MLP is sliced: each rank's output is a partial sum.
Expert parallelism (`enable_expert_parallel`) gives each rank whole experts, E / tp of them
in order: each rank computes its experts' share for every token, zero for the others, so
its output is a partial sum as well. Either way the sum over the ranks is left to the
norm after the layer.

The expert weights are read in one place, `FusedMoE.apply_experts`: a quantized variant
(FP8 weights with their scales) changes the parameters made in `__init__`, their loader, and
that call.
"""

from __future__ import annotations

import torch
from torch import nn

from minivllm.worker.distributed.parallel_state import TPGroup, divide
from minivllm.worker.layers.weights import Loaded, copy_checked, narrow
from minivllm.worker.ops._triton import use_triton
from minivllm.worker.ops.fused_moe import fused_experts, fused_experts_torch
from minivllm.worker.ops.moe_routing import select_experts

# the parts of an expert a checkpoint stores: (our parameter, its rows of the stack)
EXPERT_PARTS = {"gate": "w13_weight", "up": "w13_weight", "down": "w2_weight"}


class FusedMoE(nn.Module):
    """out[t] = sum over t's top-k experts e of weight[t, e] * down_e(silu(gate_e(x)) * up_e(x)),
    with the top-k of softmax(router_logits[t]) (renormalized to sum to 1 when `renormalize`).

    Parameters: w13_weight [E_local, 2 * I_local, H] (each expert's gate rows, then its up
    rows) and w2_weight [E_local, H, I_local]. Checkpoint tensors arrive per expert with
    shard_id (global expert id, "gate" | "up" | "down"); another rank's experts are skipped.
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
    ) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok must be in 1..{num_experts}, got {top_k}")
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        if expert_parallel:
            self.num_local_experts = divide(num_experts, tp.size)
            self.first_expert = tp.rank * self.num_local_experts
            self.inter, self.inter_rank = intermediate_size, 0
        else:
            self.num_local_experts, self.first_expert = num_experts, 0
            self.inter, self.inter_rank = divide(intermediate_size, tp.size), tp.rank
        local = self.num_local_experts
        shape13, shape2 = (local, 2 * self.inter, hidden_size), (local, hidden_size, self.inter)
        self.w13_weight = self._param(shape13, params_dtype, ("gate", "up"))
        self.w2_weight = self._param(shape2, params_dtype, ("down",))

    def _param(
        self, shape: tuple[int, ...], dtype: torch.dtype | None, parts: tuple
    ) -> nn.Parameter:
        p = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
        p.weight_loader = self.weight_loader
        # every rank expects every expert's parts (those of other ranks are read past)
        p.shards = {(e, part) for e in range(self.num_experts) for part in parts}
        return p

    def weight_loader(self, param: nn.Parameter, loaded: Loaded, shard_id: object = None) -> None:
        """Copy this rank's slice of one expert's gate [I, H], up [I, H] or down [H, I]."""
        if not (isinstance(shard_id, tuple) and len(shard_id) == 2):
            raise ValueError(f"shard_id must be (expert, part), got {shard_id!r}")
        expert, part = shard_id
        if not (isinstance(expert, int) and 0 <= expert < self.num_experts):
            raise ValueError(f"expert {expert!r} is not in 0..{self.num_experts - 1}")
        if EXPERT_PARTS.get(part) is None or (param is self.w2_weight) != (part == "down"):
            raise ValueError(f"part {part!r} does not belong to this parameter")
        local = expert - self.first_expert
        if not 0 <= local < self.num_local_experts:
            return  # another rank's expert
        n, start = self.inter, self.inter_rank * self.inter
        if part == "down":
            copy_checked(param.data[local], narrow(loaded, 1, start, n))
            return
        rows = param.data[local].narrow(0, 0 if part == "gate" else n, n)
        copy_checked(rows, narrow(loaded, 0, start, n))

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """x [T, H] (whole on every rank), router_logits [T, E] -> this rank's partial sum."""
        topk_weights, topk_ids = select_experts(router_logits, self.top_k, self.renormalize)
        return self.apply_experts(x, topk_weights, topk_ids)

    def apply_experts(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        """This rank's experts on the routed tokens: the Triton kernels where Triton runs,
        else the torch loop over experts."""
        w13, w2 = self.w13_weight, self.w2_weight
        if use_triton(x):
            return fused_experts(
                x, w13, w2, topk_weights, topk_ids, self.num_experts, self.first_expert
            )
        return fused_experts_torch(x, w13, w2, topk_weights, topk_ids, self.first_expert)
