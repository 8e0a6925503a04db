"""GGUF tensors as HF-named float32 tensors, dequantized at load.

Each tensor is dequantized whole by the `gguf` package (numpy, on the CPU); the model's
weight loaders then take their rank's slice and cast it to the model dtype. llama.cpp stores
Llama's q and k projections with the rows of each head permuted (its rotary embedding pairs
neighbouring dimensions, HF's pairs the two halves of a head); that is undone here.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from minivllm.gguf_file import ROPE_FREQS, hf_tensor_name, open_gguf


def iter_gguf_weights(path: str, hf_config: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, float32 tensor) for every tensor in GGUF file `path`, whose config
    (`gguf_file.gguf_hf_config`) is hf_config."""
    from gguf.quants import dequantize

    heads = int(hf_config["num_attention_heads"])
    kv_heads = int(hf_config.get("num_key_value_heads") or heads)
    permuted = hf_config.get("model_type") == "llama"
    for tensor in open_gguf(path).tensors:
        if tensor.name == ROPE_FREQS:
            continue  # the config's rope_scaling (gguf_file.py)
        name = hf_tensor_name(tensor.name)
        if name is None:
            raise ValueError(f"GGUF tensor {tensor.name!r} has no HF counterpart")
        # ggml lists dimensions innermost first
        shape = tuple(int(n) for n in reversed(tensor.shape))
        array = dequantize(tensor.data, tensor.tensor_type)
        if not array.flags.writeable:  # F32 comes back as a view of the read-only mapping
            array = array.copy()
        values = torch.from_numpy(array).reshape(shape)
        if permuted and ".self_attn.q_proj." in name:
            values = unpermute_rotary_rows(values, heads)
        elif permuted and ".self_attn.k_proj." in name:
            values = unpermute_rotary_rows(values, kv_heads)
        yield name, values


def unpermute_rotary_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's permutation of a q or k projection (weight or bias): within each head
    its converter interleaves the two rotary halves, row i of half 0 going to row 2i and
    row i of half 1 to row 2i + 1."""
    rows = weight.shape[0]
    half = rows // num_heads // 2
    interleaved = weight.reshape(num_heads, half, 2, *weight.shape[1:])
    return interleaved.transpose(1, 2).reshape(weight.shape).contiguous()
