"""Quantized checkpoints as the engine's config sees them: the methods the linear layers
load, the quantization_config each method's tool writes, and which method a model loads with
(its config.json's, or one asked for)."""

from __future__ import annotations

import copy
from typing import Any

# quantized linear layers (worker/layers/quantization/): a checkpoint declares one in
# config.json's quantization_config; "fp8" also quantizes a 16-bit one at load
LINEAR_QUANTIZATION_METHODS: tuple[str, ...] = ("fp8", "compressed-tensors", "awq", "gptq")
# every --quantization the loader implements: those, and a GGUF file's (dequantized at load)
QUANTIZATION_METHODS: tuple[str, ...] = (*LINEAR_QUANTIZATION_METHODS, "gguf")
_FP8_DYNAMIC_SCHEME = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True}
# the quantization_config each method's tool writes (Qwen3-*-FP8, llm-compressor's
# FP8_DYNAMIC, AutoAWQ, AutoGPTQ): what load_format="dummy" with --quantization lays out
CHECKPOINT_QUANTIZATION_CONFIGS: dict[str, dict[str, Any]] = {
    "fp8": {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "weight_block_size": [128, 128],
    },
    "compressed-tensors": {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "ignore": ["lm_head"],
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {**_FP8_DYNAMIC_SCHEME, "dynamic": False, "strategy": "channel"},
                "input_activations": {**_FP8_DYNAMIC_SCHEME, "strategy": "token"},
                "output_activations": None,
            }
        },
    },
    "awq": {
        "quant_method": "awq",
        "bits": 4,
        "group_size": 128,
        "zero_point": True,
        "version": "gemm",
        "modules_to_not_convert": None,
    },
    "gptq": {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": 128,
        "desc_act": False,
        "sym": True,
        "static_groups": False,
        "true_sequential": True,
        "damp_percent": 0.01,
        "checkpoint_format": "gptq",
    },
}


def resolve_quantization(
    requested: str | None, hf_config: dict[str, Any], load_format: str
) -> str | None:
    """The quantization method the linear layers load with: the one config.json declares
    (which `requested` must match), else `requested` -- online for "fp8"; with dummy weights
    any method, laid out as its tool writes it (hf_config gets that quantization_config).
    None for a GGUF file, whose weights are dequantized at load."""
    if requested == "gguf" or load_format == "gguf":
        return None
    declared = hf_config.get("quantization_config")
    supported = ", ".join(LINEAR_QUANTIZATION_METHODS)
    if declared is not None:
        method = str(declared.get("quant_method", "")).lower().replace("_", "-")
        if method == "gguf" and requested is None:
            # saved by transformers from a model it read from a GGUF file: it dequantized
            # the weights when it read them
            return None
        if method not in LINEAR_QUANTIZATION_METHODS:
            raise ValueError(
                f"the checkpoint's quantization_config.quant_method {method!r} is not "
                f"supported (supported: {supported})"
            )
        if requested not in (None, method):
            raise ValueError(
                f"quantization={requested!r} does not match the checkpoint's quantization "
                f"method {method!r} (config.json's quantization_config)"
            )
        return method
    if requested is None:
        return None
    if load_format == "dummy":
        hf_config["quantization_config"] = copy.deepcopy(CHECKPOINT_QUANTIZATION_CONFIGS[requested])
        return requested
    if requested != "fp8":
        raise ValueError(
            f"quantization={requested!r} loads checkpoints quantized with it, and config.json "
            "has no quantization_config; only 'fp8' quantizes a 16-bit checkpoint at load"
        )
    return requested
