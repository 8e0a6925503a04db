"""The sparse MLP of Qwen3-MoE and Mixtral, and where their checkpoints keep the experts.

A router (`gate`, the same on every rank) scores the experts for each normed token;
`FusedMoE` (layers/fused_moe.py) sums the outputs of its top-k experts. Neither has shared
experts. Which layers are sparse: `ModelConfig.is_moe_layer` (Qwen3-MoE's
`decoder_sparse_step` and `mlp_only_layers`; every layer of Mixtral).

Checkpoint names, per layer (the model's own: `mlp.gate.weight`, `mlp.experts.w13_weight`,
`mlp.experts.w2_weight`, and an FP8 checkpoint's scales beside them, `w13_weight_scale_inv`,
...):
- Qwen3-MoE: `mlp.gate.weight`, `mlp.experts.N.{gate,up,down}_proj.weight` (FP8: and
  `.weight_scale_inv`, `.weight_scale`, `.input_scale` beside each);
- Mixtral: `block_sparse_moe.gate.weight`, `block_sparse_moe.experts.N.{w1,w3,w2}.weight`
  (w1 the gate, w3 up, w2 down);
- either, as transformers 5 holds them in memory (`save_pretrained(...,
  save_original_format=False)`): `mlp.gate.weight`, `mlp.experts.gate_up_proj` [E, 2I, H]
  and `mlp.experts.down_proj` [E, H, I].
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

import torch
from torch import nn

from minivllm.config import ModelConfig
from minivllm.worker.distributed.parallel_state import TPGroup
from minivllm.worker.layers.fused_moe import EXPERT_STACKS, FusedMoE
from minivllm.worker.layers.linear import ReplicatedLinear
from minivllm.worker.layers.quantization.base import QuantizationConfig
from minivllm.worker.layers.weights import ExpertSlice, Loaded, shape_of

if TYPE_CHECKING:
    from minivllm.worker.models.llama_family import DecoderVariant


class SparseMoeBlock(nn.Module):
    """experts(x, gate(x)) for normed rows x, whole on every rank; under TP or EP the
    result is this rank's partial sum. A quantized checkpoint quantizes the experts (as its
    `quantization_config` says), never the router."""

    def __init__(
        self,
        config: ModelConfig,
        variant: DecoderVariant,
        tp: TPGroup,
        params_dtype: torch.dtype,
        layer_idx: int = 0,
        quant_config: QuantizationConfig | None = None,
    ) -> None:
        super().__init__()
        hidden = int(config.hf_config["hidden_size"])
        self.gate = ReplicatedLinear(hidden, config.num_experts, params_dtype)
        module = f"model.layers.{layer_idx}.mlp.experts"
        quant_method = quant_config.moe_method(module) if quant_config is not None else None
        self.experts = FusedMoE(
            config.num_experts,
            config.num_experts_per_tok,
            hidden,
            config.moe_intermediate_size,
            tp,
            renormalize=variant.norm_topk_prob,
            expert_parallel=variant.expert_parallel,
            params_dtype=params_dtype,
            quant_method=quant_method,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        return self.experts(x, self.gate(x))


# an expert's weight, or one of its scales in an FP8 checkpoint
_PER_EXPERT = re.compile(
    r"(.*\.)(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\."
    r"(weight|weight_scale|weight_scale_inv|input_scale)"
)
_FUSED = re.compile(r"(.*\.)mlp\.experts\.(gate_up_proj|down_proj)")
_PART_OF = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
_PART_OF |= {"w1": "gate", "w3": "up", "w2": "down"}  # Mixtral's


def moe_targets(hf_name: str, tensor: Loaded) -> list[tuple[str, object, Loaded]] | None:
    """(parameter name, shard id, tensor) for each part of an expert (or the router) in the
    checkpoint tensor `hf_name`; None when it holds none."""
    if ".block_sparse_moe.gate." in hf_name:
        return [(hf_name.replace(".block_sparse_moe.", ".mlp."), None, tensor)]
    m = _PER_EXPERT.fullmatch(hf_name)
    if m is not None and m.group(3) in _PART_OF:
        prefix, expert, part = m.group(1), int(m.group(2)), _PART_OF[m.group(3)]
        name = f"{prefix}mlp.experts.{EXPERT_STACKS[part]}_{m.group(4)}"
        return [(name, (expert, part), tensor)]
    m = _FUSED.fullmatch(hf_name)
    if m is None:
        return None
    name = m.group(1) + "mlp.experts."
    num_experts, rows = shape_of(tensor)[:2]
    if m.group(2) == "down_proj":
        return [
            (name + "w2_weight", (e, "down"), ExpertSlice(tensor, e, 0, rows))
            for e in range(num_experts)
        ]
    inter = rows // 2
    return [
        (name + "w13_weight", (e, part), ExpertSlice(tensor, e, row0, inter))
        for e in range(num_experts)
        for part, row0 in (("gate", 0), ("up", inter))
    ]


def expert_checkpoint_name(param_name: str, shard: tuple, architecture: str) -> str:
    """The per-expert checkpoint tensor that fills `shard` (expert, part) of an expert
    parameter ("model.layers.1.mlp.experts.w13_weight_scale_inv", (3, "up") ->
    "model.layers.1.mlp.experts.3.up_proj.weight_scale_inv"; Mixtral's names under
    block_sparse_moe, w1/w3/w2)."""
    prefix, param = param_name.rsplit(".", 1)
    suffix = param.split("_", 1)[1]  # w13_weight_scale_inv -> weight_scale_inv
    expert, part = shard
    if architecture == "MixtralForCausalLM":
        prefix = prefix.replace(".mlp.experts", ".block_sparse_moe.experts")
        return f"{prefix}.{expert}.{_MIXTRAL_PART_NAMES[part]}.{suffix}"
    return f"{prefix}.{expert}.{part}_proj.{suffix}"


_MIXTRAL_PART_NAMES = {"gate": "w1", "up": "w3", "down": "w2"}
