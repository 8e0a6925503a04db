"""Which attention backend a device gets: Triton on CUDA, the batched CPU one on CPU;
`MINIVLLM_ATTENTION_BACKEND=torch|cpu|triton` forces one (torch is the slow reference)."""

from __future__ import annotations

import os

from minivllm.worker.attention.backend import AttentionBackend

_BACKENDS = ("triton", "cpu", "torch")


def get_attention_backend(device_type: str) -> tuple[str, AttentionBackend]:
    default = "triton" if device_type == "cuda" else "cpu"
    name = os.environ.get("MINIVLLM_ATTENTION_BACKEND", "") or default
    if name == "triton":
        from minivllm.worker.attention.triton_attention import TritonAttentionBackend

        return name, TritonAttentionBackend()
    if name == "cpu":
        from minivllm.worker.attention.cpu_attention import CpuAttentionBackend

        return name, CpuAttentionBackend()
    if name == "torch":
        from minivllm.worker.attention.torch_attention import TorchAttentionBackend

        return name, TorchAttentionBackend()
    raise ValueError(f"MINIVLLM_ATTENTION_BACKEND must be one of {_BACKENDS}, got {name!r}")
