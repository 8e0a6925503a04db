"""Real model geometries written as config.json, so `load_format="dummy"` benchmarks need no
download; and their parameter counts, which the memory-traffic floor needs."""

from __future__ import annotations

import json
import os
from typing import Any

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
    """Parameters of a Llama-family decoder (Qwen3 q/k norms included, biases ignored)."""
    hidden = int(cfg["hidden_size"])
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    inter = int(cfg["intermediate_size"])
    vocab = int(cfg["vocab_size"])
    qk_norm = 2 * head_dim if cfg.get("model_type") == "qwen3" else 0
    per_layer = (
        hidden * (heads + 2 * kv_heads) * head_dim  # q, k, v
        + heads * head_dim * hidden  # o
        + 3 * hidden * inter  # gate, up, down
        + 2 * hidden  # the two RMSNorms
        + qk_norm
    )
    lm_head = 0 if cfg.get("tie_word_embeddings", False) else vocab * hidden
    return vocab * hidden + int(cfg["num_hidden_layers"]) * per_layer + hidden + lm_head


# bytes per weight of the decoder layers' linear layers, scales included: FP8 with a float32
# scale per 128x128 block (per row: about the same), INT4 with a float16 scale and an 8-bit
# zero per group of 128 (the kernels' layout)
_QUANTIZED_WEIGHT_BYTES = {
    "fp8": 1 + 4 / 128**2,
    "compressed-tensors": 1.0,
    "awq": 0.5 + 3 / 128,
    "gptq": 0.5 + 3 / 128,
}


def weight_bytes(cfg: dict[str, Any], dtype_bytes: int, quantization: str | None) -> int:
    """The bytes of a decoder's weights: its linear layers' in their quantized format, the
    rest (embeddings, LM head, norms) in the model's dtype."""
    total = num_parameters(cfg)
    if quantization is None:
        return total * dtype_bytes
    hidden, inter = int(cfg["hidden_size"]), int(cfg["intermediate_size"])
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    linear = int(cfg["num_hidden_layers"]) * (
        hidden * (2 * heads + 2 * kv_heads) * head_dim + 3 * hidden * inter
    )
    return int((total - linear) * dtype_bytes + linear * _QUANTIZED_WEIGHT_BYTES[quantization])
