"""Build a model for one tensor-parallel rank on its device and fill its weights."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import replace

import torch

from minivllm.config import ModelConfig
from minivllm.worker.attention.backend import AttentionBackend
from minivllm.worker.distributed.parallel_state import TPGroup
from minivllm.worker.dummy_weights import dummy_weights
from minivllm.worker.gguf_loader import iter_gguf_weights
from minivllm.worker.layers.weights import Loaded
from minivllm.worker.models.llama_family import CausalLM
from minivllm.worker.models.registry import resolve_architecture


def load_model(
    model_config: ModelConfig,
    device: torch.device,
    tp: TPGroup,
    attn_backend: AttentionBackend,
    expert_parallel: bool = False,
) -> CausalLM:
    """The model of model_config, sharded for rank tp.rank, in model_config.dtype on device.

    load_format "auto" reads the HF safetensors checkpoint (one file or sharded with an
    index), each rank reading only its slices; "dummy" loads random weights of the real
    geometry the same way (see dummy_weights.py), deterministic from model_config.seed;
    "gguf" dequantizes the tensors of a GGUF file (see gguf_loader.py). With
    expert_parallel a mixture of experts gives each rank whole experts.
    """
    model_cls, variant = resolve_architecture(model_config)
    variant = replace(variant, expert_parallel=expert_parallel)
    dtype = getattr(torch, model_config.dtype)
    # parameters are allocated uninitialized, directly on the device, in the final dtype
    with torch.device(device):
        model = model_cls(model_config, variant, tp, attn_backend, params_dtype=dtype)
    with torch.no_grad():
        if model_config.load_format == "dummy":
            if isinstance(model, CausalLM):
                weights = dummy_weights(model_config, variant, device, dtype, model.quant_config)
                model.load_weights(weights)
        elif model_config.load_format == "auto":
            model.load_weights(iter_safetensors(model_config.model))
        elif model_config.load_format == "gguf":
            model.load_weights(iter_gguf_weights(model_config.model, model_config.hf_config))
        else:
            raise ValueError(f"unknown load_format {model_config.load_format!r}")
    if device.type == "cuda" and model_config.quantization is not None:
        torch.cuda.empty_cache()  # the checkpoint layouts converted away, for the KV cache
    return model.eval()


def safetensors_files(model_dir: str) -> list[str]:
    """The checkpoint files: those named by model.safetensors.index.json, else model.safetensors."""
    index_path = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index_path):
        with open(index_path) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(model_dir, name) for name in names]
    single = os.path.join(model_dir, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    raise ValueError(
        f"no model.safetensors or model.safetensors.index.json in {model_dir!r} "
        "(use load_format='dummy' for random weights)"
    )


def iter_safetensors(model_dir: str) -> Iterator[tuple[str, Loaded]]:
    """(name, lazy slice) for every tensor in the checkpoint; a slice reads from disk only
    the part a weight loader indexes."""
    from safetensors import safe_open

    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                yield name, f.get_slice(name)
