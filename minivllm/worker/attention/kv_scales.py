"""Where an FP8 KV cache's per-layer scales come from (the arithmetic: ops/kv_cache.py).

As vLLM sets them: the checkpoint's `k_scale` / `v_scale` (or one `kv_scale` for both) when
present; else, with `calculate_kv_scales`, from the first prefill step, as max|k| / 200 and
max|v| / 100 (`ops.kv_cache.calculate_kv_scales`: headroom for later tokens beyond the first
prompt's range); else 1.0. Each layer's `PagedAttention` keeps them in `kv_scale`, float32
[2] on the device.
"""

from __future__ import annotations

import re
from typing import Any

import torch

# layers.N.self_attn.k_scale, ...self_attn.k_proj.k_scale, ...self_attn.attn.k_scale, and a
# single kv_scale for both (older checkpoints), as vLLM reads them
_SCALE_NAME = re.compile(r"layers\.(\d+)\.self_attn\.(?:[kv]_proj\.|attn\.)?(k|v|kv)_scale$")


class KVScaleLoader:
    """Takes the k/v scale tensors out of a checkpoint's stream and sets the `kv_scale` of
    each layer's `PagedAttention` from them once all are read (`finish`)."""

    def __init__(self, model: torch.nn.Module) -> None:
        from minivllm.worker.attention.layer import PagedAttention

        self.layers = {m.layer_idx: m for m in model.modules() if isinstance(m, PagedAttention)}
        self.found: dict[int, dict[str, float]] = {}

    def load(self, name: str, loaded: Any) -> bool:
        """True if `name` is a KV scale (now taken), False for any other weight."""
        match = _SCALE_NAME.search(name)
        if match is None:
            return False
        value = loaded if isinstance(loaded, torch.Tensor) else loaded[...]  # 0-d too
        if value.numel() != 1 or not float(value) > 0:
            raise ValueError(f"{name}: a KV scale must be one positive number, got {value}")
        self.found.setdefault(int(match.group(1)), {})[match.group(2)] = float(value)
        return True

    def finish(self) -> bool:
        """Write the scales read; True if the checkpoint had any."""
        for i, scales in self.found.items():
            both = scales.get("kv", 1.0)
            k, v = scales.get("k", both), scales.get("v", both)
            self.layers[i].kv_scale.copy_(torch.tensor([k, v]))
        return bool(self.found)
