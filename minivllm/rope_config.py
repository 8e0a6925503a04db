"""The rotary position embedding a checkpoint's config.json asks for, read without torch.

The worker builds its cos/sin table from it (`worker/ops/rotary.py`), and the engine config
reads it too: linear and YaRN scaling lengthen the context a model takes (vLLM's rule), and
LongRoPE switches between its short and long factors per sequence, which the scheduler
must know (`long_rope_threshold`).
"""

from __future__ import annotations

from typing import Any

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")
_ALIASES = {"su": "longrope"}  # the name the first long Phi-3 checkpoints use
_REQUIRED_KEYS = {
    "linear": ("factor",),
    "dynamic": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
    "yarn": (),  # factor: max_position_embeddings / original_max_position_embeddings
    "longrope": ("short_factor", "long_factor"),
}
# types that scale from the length the model was pretrained at
_WITH_ORIGINAL_LEN = ("llama3", "yarn", "longrope")
# what the engine config reads of a config with rope settings per layer type
GLOBAL_LAYER_TYPE = "full_attention"


def max_position_embeddings(hf_config: dict[str, Any]) -> int:
    return int(hf_config.get("max_position_embeddings") or 2048)


def _per_layer_type(rope: dict[str, Any]) -> bool:
    """transformers 5 nests rope_parameters by layer type where layers differ (Gemma 3:
    {"sliding_attention": {...}, "full_attention": {...}})."""
    return bool(rope) and all(isinstance(v, dict) or v is None for v in rope.values())


def _settings_per_layer_type(hf_config: dict[str, Any]) -> dict[str, dict[str, Any]] | None:
    """The rope settings of each layer type, or None where every layer shares one: transformers
    5's nested rope_parameters, or Gemma 3's older layout, read as transformers 5 reads it
    (rope_theta and rope_scaling are the full-attention layers', rope_local_base_freq the
    sliding layers' base, with no scaling)."""
    saved = hf_config.get("rope_parameters") or {}
    if _per_layer_type(saved):
        return {name: dict(v or {}) for name, v in saved.items()}
    if "rope_local_base_freq" not in hf_config:
        return None
    local = float(hf_config["rope_local_base_freq"])
    return {
        "sliding_attention": {"rope_type": "default", "rope_theta": local},
        GLOBAL_LAYER_TYPE: dict(saved),  # rope_theta and rope_scaling are read over it
    }


def rope_parameters(hf_config: dict[str, Any], layer_type: str | None = None) -> dict[str, Any]:
    """The rope settings of config.json in one dict, completed as transformers completes
    them: `rope_type`, `rope_theta`, `partial_rotary_factor`, the type's own keys, and for
    llama3, yarn and longrope `original_max_position_embeddings` (config.json's top-level
    value where Phi-3 puts it, else the dict's, else max_position_embeddings) and for yarn
    and longrope `factor` (max_position_embeddings over the original length when unset).

    Either layout: transformers 5's `rope_parameters`, or a top-level `rope_theta` with
    `rope_scaling`, which wins where both are given, as in transformers (an override of
    rope_scaling, vLLM's way to turn YaRN on, over a config that transformers 5 saved). A type
    not supported, or a key its type needs that is missing, is a ValueError naming them.
    Given per layer type, the settings of `layer_type` (ValueError without one), as
    transformers 5 reads them: its own rope_theta first, and top-level rope_theta and
    rope_scaling only for the full-attention layers."""
    saved = hf_config.get("rope_parameters") or {}
    per_type = _settings_per_layer_type(hf_config)
    if per_type is not None:
        if layer_type is None:
            raise ValueError(
                f"rope settings are given per layer type ({', '.join(per_type)}): "
                "the rotary embedding must name its layers' type"
            )
        saved = per_type.get(layer_type) or {}
        # the top-level rope_theta and rope_scaling are the full-attention layers', whose
        # own nested rope_theta wins
        shadowed = {"rope_theta"} if saved.get("rope_theta") is not None else set()
        if layer_type != GLOBAL_LAYER_TYPE:
            shadowed |= {"rope_theta", "rope_scaling"}
        hf_config = {k: v for k, v in hf_config.items() if k not in shadowed}
    params = dict(hf_config.get("rope_scaling") or saved)
    legacy_type = params.pop("type", None)  # the older spelling of rope_type
    rope_type = params.get("rope_type") or legacy_type or "default"
    rope_type = _ALIASES.get(rope_type, rope_type)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope type {rope_type!r} (config.json rope_scaling) is not supported; "
            f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    params["rope_type"] = rope_type
    if params.get("rope_theta") is None:
        params["rope_theta"] = float(
            hf_config.get("rope_theta") or saved.get("rope_theta") or 10000.0
        )
    if params.get("partial_rotary_factor") is None:
        top = hf_config.get("partial_rotary_factor")
        params["partial_rotary_factor"] = float(top or saved.get("partial_rotary_factor") or 1.0)
    missing = [key for key in _REQUIRED_KEYS.get(rope_type, ()) if params.get(key) is None]
    if missing:
        raise ValueError(f"rope type {rope_type!r} needs {', '.join(missing)} in rope_scaling")
    if rope_type in _WITH_ORIGINAL_LEN:
        top = hf_config.get("original_max_position_embeddings")
        if top is not None:
            params["original_max_position_embeddings"] = top
        elif params.get("original_max_position_embeddings") is None:
            params["original_max_position_embeddings"] = max_position_embeddings(hf_config)
        params["original_max_position_embeddings"] = int(params["original_max_position_embeddings"])
    if rope_type in ("yarn", "longrope") and params.get("factor") is None:
        original = params["original_max_position_embeddings"]
        params["factor"] = max_position_embeddings(hf_config) / original
    return params


def rotary_dim(head_dim: int, params: dict[str, Any]) -> int:
    """How many leading dims of each head rotate (all of them unless partial_rotary_factor
    says less, as Phi-4-mini's 0.75 does); ValueError if that is not a positive even number."""
    factor = float(params["partial_rotary_factor"])
    dim = int(head_dim * factor)
    if not 0.0 < factor <= 1.0 or dim <= 0 or dim % 2:
        raise ValueError(
            f"partial_rotary_factor {factor} of head_dim {head_dim} gives {dim} rotary dims; "
            "it must be in (0, 1] and give a positive even number"
        )
    return dim


def max_len_with_scaling(hf_config: dict[str, Any]) -> int:
    """The longest context the checkpoint takes, derived as vLLM derives it: linear scaling
    multiplies max_position_embeddings by its factor, YaRN's is its original length times its
    factor; llama3 and longrope checkpoints give the scaled length as max_position_embeddings
    already. Dynamic NTK stays at max_position_embeddings: transformers rescales its
    frequencies with the length of each sequence past it, which a paged KV cache (keys
    rotated once) cannot follow, and up to it the frequencies are the default ones. A config
    with rope settings per layer type (Gemma 3) states its scaled length as
    max_position_embeddings too (vLLM does not scale it again)."""
    if _settings_per_layer_type(hf_config) is not None:
        rope_parameters(hf_config, GLOBAL_LAYER_TYPE)  # still refuses a kind not supported
        return max_position_embeddings(hf_config)
    params = rope_parameters(hf_config)
    rope_type = params["rope_type"]
    if rope_type == "linear":
        return int(max_position_embeddings(hf_config) * float(params["factor"]))
    if rope_type == "yarn":
        return int(params["original_max_position_embeddings"] * float(params["factor"]))
    return max_position_embeddings(hf_config)


def long_rope_threshold(hf_config: dict[str, Any], max_model_len: int) -> int | None:
    """LongRoPE's switch: the length past which a sequence is rotated with the long factors,
    every token of it (its original_max_position_embeddings), as transformers does; None for
    other rope types and where no sequence can grow past it (max_model_len at most that)."""
    params = rope_parameters(hf_config, GLOBAL_LAYER_TYPE)
    if params["rope_type"] != "longrope":
        return None
    threshold = params["original_max_position_embeddings"]
    return threshold if max_model_len > threshold else None
