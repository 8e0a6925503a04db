"""GGUF files (llama.cpp's format) as models: what a file must hold for us to run it, and the
HF config and tensor names it stands for.

The file's metadata is the config (llama.cpp's key names, one prefix per architecture); its
tensors are named `blk.N.attn_q.weight` and so on. Everything here reads metadata only: the
worker dequantizes the tensors (`worker/gguf_loader.py`).
"""

from __future__ import annotations

import os
import re
from typing import Any

import numpy as np

# llama.cpp's architecture name -> ours (config.json's "architectures"). Mistral files say
# "llama": llama.cpp converts them as Llama.
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

# The tensor types dequantized at load: float, llama.cpp's legacy block quants and k-quants.
SUPPORTED_TENSOR_TYPES = (
    "F32",
    "F16",
    "BF16",
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q8_0",
    "Q2_K",
    "Q3_K",
    "Q4_K",
    "Q5_K",
    "Q6_K",
)

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_BLOCK_NAME = re.compile(r"blk\.(\d+)\.(.+)")
# Llama 3.1 and later: llama.cpp writes HF's "llama3" RoPE scaling as one factor per
# frequency, this tensor, which the config reads back (it is no weight)
ROPE_FREQS = "rope_freqs.weight"
# the scaling every such Llama uses but its factor; a file's factors are checked against it
_LLAMA3_ROPE = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def is_gguf_path(path: str) -> bool:
    """Whether `path` names a GGUF file: a `.gguf` name, or a file that starts with GGUF's
    magic bytes."""
    if path.endswith(".gguf"):
        return True
    if not os.path.isfile(path):
        return False
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def pretrained_args(path: str) -> tuple[str, dict[str, Any]]:
    """(name, kwargs) for transformers' `from_pretrained` (tokenizers, configs) of `path`: a
    GGUF file is its directory plus `gguf_file=` its name, anything else itself."""
    if is_gguf_path(path):
        return os.path.dirname(os.path.abspath(path)), {"gguf_file": os.path.basename(path)}
    return path, {}


def hf_tensor_name(gguf_name: str) -> str | None:
    """The HF checkpoint name of a GGUF tensor (`blk.3.attn_q.weight` ->
    `model.layers.3.self_attn.q_proj.weight`), or None for one with no counterpart."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    match = _BLOCK_NAME.fullmatch(gguf_name)
    if match is None or match.group(2) not in _BLOCK_TENSORS:
        return None
    return f"model.layers.{match.group(1)}.{_BLOCK_TENSORS[match.group(2)]}"


def open_gguf(path: str) -> Any:
    """A `gguf.GGUFReader` of `path` (the tensors are memory-mapped, read when touched)."""
    if not os.path.isfile(path):
        raise ValueError(f"model: no GGUF file at {path!r}")
    from gguf import GGUFReader

    try:
        return GGUFReader(path)
    except ValueError as e:
        raise ValueError(f"model: {path!r} is not a readable GGUF file: {e}") from None


def gguf_hf_config(path: str) -> dict[str, Any]:
    """The HF config (config.json's keys) of the model in GGUF file `path`, after checking
    that we can run it: a supported architecture, every tensor of a supported type and with a
    counterpart in that architecture. Raises ValueError naming what is supported."""
    reader = open_gguf(path)
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported; supported: "
            f"{', '.join(GGUF_ARCHITECTURES)}"
        )
    if int(_field(reader, "split.count", 1)) > 1:
        raise ValueError(
            f"GGUF file {path!r} is one part of a split model, which is not supported; "
            "merge the parts into one file (llama.cpp's `llama-gguf-split --merge`)"
        )
    _check_tensors(reader, arch)
    names = {t.name for t in reader.tensors}
    config = _config_from_metadata(reader, arch)
    config["tie_word_embeddings"] = "output.weight" not in names
    if arch == "llama":
        config["attention_bias"] = "blk.0.attn_q.bias" in names
    freqs = next((t for t in reader.tensors if t.name == ROPE_FREQS), None)
    if freqs is not None:
        config["rope_scaling"] = _llama3_rope_scaling(
            np.asarray(freqs.data, dtype=np.float64), config["head_dim"], config["rope_theta"]
        )
    return config


def _llama3_rope_scaling(factors: np.ndarray, head_dim: int, theta: float) -> dict[str, Any]:
    """HF's "llama3" rope_scaling whose per-frequency factors (llama.cpp's converter's
    formula) are `factors`; ValueError if no such scaling gives them."""
    scaling = {"rope_type": "llama3", "factor": float(factors.max()), **_LLAMA3_ROPE}
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * np.pi * theta ** (np.arange(0, head_dim, 2) / head_dim)
    smooth = (old_len / wavelen - low) / (high - low)
    expected = np.where(
        wavelen < old_len / high,
        1.0,
        np.where(
            wavelen > old_len / low,
            scaling["factor"],
            1 / ((1 - smooth) / scaling["factor"] + smooth),
        ),
    )
    if factors.shape != expected.shape or not np.allclose(factors, expected, rtol=1e-4):
        raise ValueError(
            f"GGUF tensor {ROPE_FREQS!r} holds RoPE factors that are not Llama 3's scaling "
            f"(any factor with {_LLAMA3_ROPE}); only that scaling is supported"
        )
    return scaling


def _config_from_metadata(reader: Any, arch: str) -> dict[str, Any]:
    def key(name: str, default: Any = KeyError) -> Any:
        return _field(reader, f"{arch}.{name}", default)

    heads, hidden = int(key("attention.head_count")), int(key("embedding_length"))
    head_dim = int(key("attention.key_length", 0) or key("rope.dimension_count", 0)) or (
        hidden // heads
    )
    rotary_dims = key("rope.dimension_count", head_dim)
    if rotary_dims != head_dim:
        raise ValueError(
            f"GGUF file rotates {rotary_dims} of each head's {head_dim} dimensions; only "
            "full-head rotary embeddings are supported"
        )
    scaling = key("rope.scaling.type", "none")
    if scaling != "none":
        raise ValueError(f"GGUF rope scaling {scaling!r} is not supported; only none")
    vocab = key("vocab_size", None)
    if vocab is None:
        vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    return {
        "architectures": [GGUF_ARCHITECTURES[arch]],
        "model_type": arch,
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(key("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(key("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(key("context_length")),
        "vocab_size": int(vocab),
        "hidden_act": "silu",
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id", None),
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id", None),
        "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id", None),
        # the file states no compute dtype; on a GPU the dequantized weights run in bf16
        "torch_dtype": "bfloat16",
    }


def _check_tensors(reader: Any, arch: str) -> None:
    for tensor in reader.tensors:
        type_name = tensor.tensor_type.name
        if type_name not in SUPPORTED_TENSOR_TYPES:
            raise ValueError(
                f"GGUF tensor {tensor.name!r} has type {type_name}, which is not supported; "
                f"supported: {', '.join(SUPPORTED_TENSOR_TYPES)}"
            )
    unknown = [
        t.name
        for t in reader.tensors
        if hf_tensor_name(t.name) is None and not (t.name == ROPE_FREQS and arch == "llama")
    ]
    if unknown:
        raise ValueError(
            f"GGUF tensors with no counterpart in {GGUF_ARCHITECTURES[arch]}: {unknown} "
            "(supported per block: "
            f"{', '.join(_BLOCK_TENSORS)}; and {', '.join(_GLOBAL_TENSORS)})"
        )


def _field(reader: Any, name: str, default: Any = KeyError) -> Any:
    field = reader.fields.get(name)
    if field is None:
        if default is KeyError:
            raise ValueError(f"GGUF file has no metadata key {name!r}")
        return default
    return field.contents()
