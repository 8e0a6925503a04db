"""Real model geometries written as config.json, so `load_format="dummy"` benchmarks need no
download; and their parameter counts, which the memory-traffic floor needs."""

from __future__ import annotations

import json
import os
from typing import Any

from minivllm.config import ModelConfig

_QWEN3_COMMON: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 151936,
    "head_dim": 128,
    "num_key_value_heads": 8,
    "max_position_embeddings": 40960,
    "rope_theta": 1000000,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "attention_bias": False,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": True,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}

GEOMETRIES: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": {
        **_QWEN3_COMMON,
        "num_hidden_layers": 28,
        "hidden_size": 1024,
        "num_attention_heads": 16,
        "intermediate_size": 3072,
    },
    "qwen3-8b": {
        **_QWEN3_COMMON,
        "num_hidden_layers": 36,
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "intermediate_size": 12288,
        "tie_word_embeddings": False,
    },
    # Qwen3-0.6B's shape cut down for 2 CPU cores: the CPU path's cost is per sequence and
    # per vocabulary entry (reference attention, sorting sampler), so few layers, a small
    # hidden size and the smallest vocabulary that holds the reference prompts' ids.
    "qwen3-cpu-tiny": {
        **_QWEN3_COMMON,
        "num_hidden_layers": 2,
        "hidden_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "intermediate_size": 384,
        "vocab_size": 10240,  # covers the reference prompts' ids (0..10000)
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    },
}

# the mixtures of experts, as published (config.json of Qwen/Qwen3-30B-A3B and
# mistralai/Mixtral-8x7B-v0.1)
GEOMETRIES["qwen3-30b-a3b"] = {
    **_QWEN3_COMMON,
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "num_hidden_layers": 48,
    "hidden_size": 2048,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "tie_word_embeddings": False,
}
GEOMETRIES["mixtral-8x7b"] = {
    "architectures": ["MixtralForCausalLM"],
    "model_type": "mixtral",
    "vocab_size": 32000,
    "num_hidden_layers": 32,
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "intermediate_size": 14336,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "sliding_window": None,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

# Gemma 3 1B (google/gemma-3-1b-it's config.json): 5 of 6 layers attend over 512 tokens
GEOMETRIES["gemma3-1b"] = {
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "vocab_size": 262144,
    "num_hidden_layers": 26,
    "hidden_size": 1152,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 256,
    "intermediate_size": 6912,
    "hidden_activation": "gelu_pytorch_tanh",
    "query_pre_attn_scalar": 256,
    "sliding_window": 512,
    "sliding_window_pattern": 6,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000,
    "rope_local_base_freq": 10000,
    "rope_scaling": None,
    "rms_norm_eps": 1e-6,
    "attention_bias": False,
    "final_logit_softcapping": None,
    "attn_logit_softcapping": None,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": True,
    "bos_token_id": 2,
    "eos_token_id": [1, 106],
}

DEFAULT_GPU_GEOMETRY = "qwen3-0.6b"
DEFAULT_CPU_GEOMETRY = "qwen3-cpu-tiny"


def write_geometry(name: str, out_dir: str) -> str:
    """Write `GEOMETRIES[name]` as out_dir/config.json and return out_dir."""
    if name not in GEOMETRIES:
        raise ValueError(f"geometry must be one of {sorted(GEOMETRIES)}, got {name!r}")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(GEOMETRIES[name], f, indent=2)
    return out_dir


def num_parameters(cfg: dict[str, Any]) -> int:
    """Parameters of a Llama-family decoder (q/k norms and Gemma 3's four norms per layer
    included, biases ignored), the experts and routers of its sparse layers included."""
    hidden, inter = int(cfg["hidden_size"]), int(cfg["intermediate_size"])
    # a sparse layer holds E experts and a router in place of the dense MLP
    per_sparse_layer = num_experts(cfg) * (expert_parameters(cfg) + hidden) - 3 * hidden * inter
    return _dense_parameters(cfg) + sparse_layers(cfg) * per_sparse_layer


def num_experts(cfg: dict[str, Any]) -> int:
    """Routed experts of each sparse layer; 0 for a dense model."""
    return _model_config(cfg).num_experts


def expert_parameters(cfg: dict[str, Any]) -> int:
    """Parameters of one expert of one sparse layer (gate, up, down)."""
    return 3 * int(cfg["hidden_size"]) * _model_config(cfg).moe_intermediate_size


def sparse_layers(cfg: dict[str, Any]) -> int:
    """Layers whose MLP is a mixture of experts."""
    model = _model_config(cfg)
    return sum(model.is_moe_layer(i) for i in range(model.num_layers))


def _model_config(cfg: dict[str, Any]) -> ModelConfig:
    """The geometry read as the engine reads it (which layers are sparse, how many experts)."""
    return ModelConfig("", "", "float32", 1, 0, "dummy", cfg, ())


def _dense_parameters(cfg: dict[str, Any]) -> int:
    hidden = int(cfg["hidden_size"])
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    inter = int(cfg["intermediate_size"])
    vocab = int(cfg["vocab_size"])
    gemma = cfg["architectures"][0].startswith("Gemma3")
    qk_norm = 2 * head_dim if gemma or cfg.get("model_type") in ("qwen3", "qwen3_moe") else 0
    per_layer = (
        hidden * (heads + 2 * kv_heads) * head_dim  # q, k, v
        + heads * head_dim * hidden  # o
        + 3 * hidden * inter  # gate, up, down
        + (4 if gemma else 2) * hidden  # the RMSNorms (Gemma's after attention and MLP too)
        + qk_norm
    )
    lm_head = 0 if cfg.get("tie_word_embeddings", False) else vocab * hidden
    return vocab * hidden + int(cfg["num_hidden_layers"]) * per_layer + hidden + lm_head


# bytes per weight of the decoder layers' linear layers and experts, scales included: FP8
# with a float32 scale per 128x128 block (per row: about the same), INT4 with a float16 scale
# and an 8-bit zero per group of 128 (the kernels' layout)
_QUANTIZED_WEIGHT_BYTES = {
    "fp8": 1 + 4 / 128**2,
    "compressed-tensors": 1.0,
    "awq": 0.5 + 3 / 128,
    "gptq": 0.5 + 3 / 128,
}


def bytes_per_weight(dtype_bytes: int, quantization: str | None) -> float:
    """Bytes of one weight of a linear layer (or an expert) in this format."""
    return dtype_bytes if quantization is None else _QUANTIZED_WEIGHT_BYTES[quantization]


def weight_bytes(cfg: dict[str, Any], dtype_bytes: int, quantization: str | None) -> int:
    """The bytes of a decoder's weights: its linear layers' and experts' in their quantized
    format, the rest (embeddings, LM head, norms, routers) in the model's dtype."""
    total = num_parameters(cfg)
    if quantization is None:
        return total * dtype_bytes
    hidden, inter = int(cfg["hidden_size"]), int(cfg["intermediate_size"])
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    layers, sparse = int(cfg["num_hidden_layers"]), sparse_layers(cfg)
    linear = (
        layers * hidden * (2 * heads + 2 * kv_heads) * head_dim
        + (layers - sparse) * 3 * hidden * inter
        + sparse * num_experts(cfg) * expert_parameters(cfg)
    )
    per_weight = bytes_per_weight(dtype_bytes, quantization)
    return int((total - linear) * dtype_bytes + linear * per_weight)
