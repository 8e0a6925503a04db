"""Which attention backend a device gets.

On CUDA: flash-attn when the package imports and its kernels cover the configuration (page
size, head dim, the KV cache's dtype: not FP8), else Triton. On CPU: the batched CPU backend.
`MINIVLLM_ATTENTION_BACKEND=flash-attn|triton|cpu|torch` forces one (torch is the slow
reference); forcing flash-attn where it cannot run is an error, not a silent fallback.
"""

from __future__ import annotations

import importlib
import logging

import torch

from minivllm import envs
from minivllm.worker.attention.backend import AttentionBackend
from minivllm.worker.attention.flash_attention import flash_attn_unsupported_reason

logger = logging.getLogger(__name__)

# name -> (module in this package, class); imported lazily: triton and flash-attn are
# optional and slow to import
_BACKENDS = {
    "flash-attn": ("flash_attention", "FlashAttentionBackend"),
    "triton": ("triton_attention", "TritonAttentionBackend"),
    "cpu": ("cpu_attention", "CpuAttentionBackend"),
    "torch": ("torch_attention", "TorchAttentionBackend"),
}


def get_attention_backend(
    device_type: str, *, block_size: int, head_dim: int, dtype: torch.dtype
) -> tuple[str, AttentionBackend]:
    """The backend's name and instance; logs the choice and the reason for it."""
    name = envs.attention_backend()
    if name:
        if name not in _BACKENDS:
            raise ValueError(
                f"MINIVLLM_ATTENTION_BACKEND must be one of {tuple(_BACKENDS)}, got {name!r}"
            )
        why = "set by MINIVLLM_ATTENTION_BACKEND"
        if name == "flash-attn":
            if device_type != "cuda":
                problem = f"flash-attn needs a CUDA device, not {device_type}"
            else:
                problem = flash_attn_unsupported_reason(block_size, head_dim, dtype)
            if problem:
                raise ValueError(f"MINIVLLM_ATTENTION_BACKEND=flash-attn cannot run: {problem}")
    elif device_type != "cuda":
        name, why = "cpu", f"{device_type} device"
    else:
        problem = flash_attn_unsupported_reason(block_size, head_dim, dtype)
        name, why = ("triton", problem) if problem else ("flash-attn", "flash-attn supports it")
    logger.info("attention backend: %s; %s", name, why)
    module, cls = _BACKENDS[name]
    return name, getattr(importlib.import_module(f"{__package__}.{module}"), cls)()
