"""The flat config of a multimodal checkpoint's language model, which the engine serves alone.

Gemma 3 4B and larger are `Gemma3ForConditionalGeneration`: a vision tower, a projector and
a Gemma 3 text model. Their config.json nests the text model's settings under `text_config`,
writing only those that differ from transformers' `Gemma3TextConfig` defaults. The engine
serves the text model (text prompts; no images), from one flat config: the defaults, the
checkpoint's text settings over them, and its top-level keys (architecture, EOS ids, dtype)
over those.
"""

from __future__ import annotations

from typing import Any

# transformers' Gemma3TextConfig defaults, for the keys the text model reads
GEMMA3_TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "sliding_window_pattern": 6,
    "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10_000.0,
    "final_logit_softcapping": None,
    "attn_logit_softcapping": None,
}

# architecture -> the defaults of its language model's config class
_TEXT_MODELS = {"Gemma3ForConditionalGeneration": GEMMA3_TEXT_DEFAULTS}


def language_model_config(hf_config: dict[str, Any]) -> dict[str, Any]:
    """hf_config as it is, or, for a multimodal checkpoint whose language model the engine
    serves, that model's flat config (see the module's docstring)."""
    arch = (hf_config.get("architectures") or [""])[0]
    defaults = _TEXT_MODELS.get(arch)
    if defaults is None or "text_config" not in hf_config:
        return hf_config
    top = {k: v for k, v in hf_config.items() if k not in ("text_config", "vision_config")}
    return {**defaults, **(hf_config["text_config"] or {}), **top}
