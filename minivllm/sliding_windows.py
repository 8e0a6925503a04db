"""Which layers of a checkpoint attend over a sliding window, read from its config.json.

A layer with window W lets the query at position p see the keys at positions p - W + 1 .. p
(HF's `kv_idx > q_idx - sliding_window`). The worker masks each layer's attention by its
window; the engine-core frees the KV blocks behind the window when every layer has one.

The layouts checkpoints use:
- `layer_types` (transformers >= 4.53): "sliding_attention" layers take `sliding_window`,
  "full_attention" layers attend to the whole context;
- Gemma 3 before it: `sliding_window_pattern` P (6 by default), every P-th layer global;
- Qwen2 / Qwen3: only with `use_sliding_window`, the layers from `max_window_layers` on;
- otherwise (Mistral, Mixtral, Phi-3) `sliding_window`, when set, applies to every layer.
"""

from __future__ import annotations

from typing import Any

_SLIDING, _FULL = "sliding_attention", "full_attention"


def sliding_layers(hf_config: dict[str, Any], num_layers: int) -> tuple[bool, ...]:
    """Which layers the checkpoint makes sliding-window layers, whatever the window (Gemma 3
    gives them their own RoPE base even where the window masks nothing)."""
    types = hf_config.get("layer_types")
    archs = hf_config.get("architectures") or [""]
    if types is not None:
        if len(types) != num_layers:
            raise ValueError(f"layer_types has {len(types)} entries for {num_layers} layers")
        unknown = sorted(set(types) - {_SLIDING, _FULL})
        if unknown:
            raise ValueError(
                f"layer_types {unknown} are not supported; supported: {_SLIDING!r}, {_FULL!r}"
            )
        return tuple(t == _SLIDING for t in types)
    if "sliding_window_pattern" in hf_config or archs[0].startswith("Gemma3"):
        pattern = int(hf_config.get("sliding_window_pattern") or 6)
        return tuple(bool((i + 1) % pattern) for i in range(num_layers))
    if "max_window_layers" in hf_config:
        first = int(hf_config["max_window_layers"])
        return tuple(i >= first for i in range(num_layers))
    return (True,) * num_layers


def layer_sliding_windows(
    hf_config: dict[str, Any], num_layers: int, max_model_len: int
) -> tuple[int | None, ...]:
    """Each layer's window in tokens, or None for a layer that sees the whole context. A
    window of max_model_len tokens or more masks nothing, and is None too."""
    window = hf_config.get("sliding_window")
    if not window or not hf_config.get("use_sliding_window", True):
        return (None,) * num_layers
    window = int(window)
    if window < 1:
        raise ValueError(f"sliding_window must be a positive number of tokens, got {window}")
    effective = window if window < max_model_len else None
    return tuple(effective if s else None for s in sliding_layers(hf_config, num_layers))


def kv_sliding_window(windows: tuple[int | None, ...]) -> int | None:
    """The window behind which no layer reads the KV cache: the largest, when every layer
    has one; None when some layer attends to the whole context (its blocks are all needed,
    since every layer shares one block table)."""
    if not windows or any(w is None for w in windows):
        return None
    return max(w for w in windows if w is not None)
