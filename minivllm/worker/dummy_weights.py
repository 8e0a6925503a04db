"""Random weights of a real geometry, named and shaped as in an HF checkpoint (a mixture of
experts' experts as transformers 5 holds them, two 3-D tensors per layer).

They go through the same `load_weights` path as a checkpoint, so every tensor-parallel rank
takes its slice of the same full tensor: TP=2 computes the same model as TP=1. Each tensor
is drawn from a generator seeded by (seed, name), so the values do not depend on the order
of loading either.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator

import torch

from minivllm.config import ModelConfig
from minivllm.worker.layers.quantization.base import QuantizationConfig
from minivllm.worker.models.llama_family import DecoderVariant


def hf_weight_shapes(config: ModelConfig, variant: DecoderVariant) -> dict[str, tuple[int, ...]]:
    """Every tensor a Llama-family HF checkpoint of this geometry holds, by name."""
    h = int(config.hf_config["hidden_size"])
    attention, dense = _layer_shapes(config, variant), _dense_mlp_shapes(config, variant)
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, h)}
    for i in range(config.num_layers):
        mlp = _sparse_mlp_shapes(config) if config.is_moe_layer(i) else dense
        layer = {**attention, **mlp}
        if variant.fused_checkpoint:
            layer = _fused(layer)
        shapes.update({f"model.layers.{i}.{name}": shape for name, shape in layer.items()})
    shapes["model.norm.weight"] = (h,)
    if not variant.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    return shapes


def _layer_shapes(config: ModelConfig, variant: DecoderVariant) -> dict[str, tuple[int, ...]]:
    """A layer's attention and norms."""
    hf = config.hf_config
    h, d = int(hf["hidden_size"]), config.head_dim
    q, kv = config.num_attention_heads * d, config.num_kv_heads * d
    layer = {
        "self_attn.q_proj.weight": (q, h),
        "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h),
        "self_attn.o_proj.weight": (h, q),
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
    }
    if variant.qkv_bias:
        layer.update(
            {f"self_attn.{x}_proj.bias": (n,) for x, n in (("q", q), ("k", kv), ("v", kv))}
        )
    if variant.o_proj_bias:
        layer["self_attn.o_proj.bias"] = (h,)
    if variant.qk_norm:
        layer.update({"self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,)})
    if variant.sandwich_norms:
        layer.update({"pre_feedforward_layernorm.weight": (h,)})
        layer.update({"post_feedforward_layernorm.weight": (h,)})
    return layer


def _dense_mlp_shapes(config: ModelConfig, variant: DecoderVariant) -> dict[str, tuple[int, ...]]:
    h, inter = int(config.hf_config["hidden_size"]), int(config.hf_config["intermediate_size"])
    mlp = {
        "mlp.gate_proj.weight": (inter, h),
        "mlp.up_proj.weight": (inter, h),
        "mlp.down_proj.weight": (h, inter),
    }
    if variant.mlp_bias:
        mlp.update({"mlp.gate_proj.bias": (inter,), "mlp.up_proj.bias": (inter,)})
        mlp["mlp.down_proj.bias"] = (h,)
    return mlp


def _sparse_mlp_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    h, e = int(config.hf_config["hidden_size"]), config.num_experts
    inter = config.moe_intermediate_size
    return {
        "mlp.gate.weight": (e, h),
        "mlp.experts.gate_up_proj": (e, 2 * inter, h),
        "mlp.experts.down_proj": (e, h, inter),
    }


# Phi-3's checkpoints: q/k/v rows stacked in one qkv_proj tensor, gate/up in one gate_up_proj
_FUSED_IN_CHECKPOINT = {
    "self_attn.q_proj": "self_attn.qkv_proj",
    "self_attn.k_proj": "self_attn.qkv_proj",
    "self_attn.v_proj": "self_attn.qkv_proj",
    "mlp.gate_proj": "mlp.gate_up_proj",
    "mlp.up_proj": "mlp.gate_up_proj",
}


def _fused(layer: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    out: dict[str, tuple[int, ...]] = {}
    for name, shape in layer.items():
        module, suffix = name.rsplit(".", 1)
        fused = _FUSED_IN_CHECKPOINT.get(module)
        if fused is None:
            out[name] = shape
            continue
        key = f"{fused}.{suffix}"
        rows = out[key][0] if key in out else 0
        out[key] = (rows + shape[0], *shape[1:])
    return out


def dummy_weights(
    config: ModelConfig,
    variant: DecoderVariant,
    device: torch.device,
    dtype: torch.dtype,
    quant_config: QuantizationConfig | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) pairs: norms 1 (Gemma's stored offset 0), matrices
    N(0, initializer_range), biases small. With a quantization format, the linear layers'
    weights (and experts) are quantized and stored as that format's checkpoints store them
    (FP8 blocks and their scales, packed INT4, ...): the same weights as without one, before
    quantizing."""
    std = float(config.hf_config.get("initializer_range", 0.02))
    norm_fill = 0.0 if variant.norm_offset else 1.0
    for name, shape in hf_weight_shapes(config, variant).items():
        if name.endswith("norm.weight"):
            yield name, torch.full(shape, norm_fill, dtype=dtype, device=device)
            continue
        digest = hashlib.sha256(f"{config.seed}:{name}".encode()).digest()
        gen = torch.Generator(device=device).manual_seed(int.from_bytes(digest[:8], "little") >> 1)
        tensor = torch.empty(shape, dtype=torch.float32, device=device)
        tensor.normal_(0.0, std if len(shape) > 1 else std / 10, generator=gen)
        experts = _FUSED_EXPERTS.search(name)
        module = name.removesuffix(".weight") if experts is None else name[: experts.start()]
        quantized = _LINEAR.search(name) or experts
        if quant_config is None or not quantized or quant_config.is_ignored(module):
            yield name, tensor.to(dtype)
        elif experts is None:
            for suffix, value in quant_config.checkpoint_tensors(module, tensor).items():
                yield f"{module}.{suffix}", value
        else:
            yield from _quantized_experts(module, experts.group(1), tensor, quant_config)


# the linear layers' weights, which a quantized checkpoint stores in its format
_LINEAR = re.compile(r"\.(q|k|v|o|gate|up|down)_proj\.weight$")
_FUSED_EXPERTS = re.compile(r"\.(gate_up_proj|down_proj)$")


def _quantized_experts(
    module: str, stack: str, tensor: torch.Tensor, quant_config: QuantizationConfig
) -> Iterator[tuple[str, torch.Tensor]]:
    """A stack of experts (gate_up [E, 2I, H] or down [E, H, I]) as a quantized checkpoint
    stores it: each expert's gate, up and down quantized on their own (Qwen3-*-FP8's names)."""
    parts = ("down_proj",) if stack == "down_proj" else ("gate_proj", "up_proj")
    for e, weights in enumerate(tensor):
        for part, w in zip(parts, weights.chunk(len(parts)), strict=True):
            name = f"{module}.{e}.{part}"
            for suffix, value in quant_config.checkpoint_tensors(name, w).items():
                yield f"{name}.{suffix}", value
