"""Quantized linear layers: one module per checkpoint format, and the registry that picks the
format of a model (config.json's `quantization_config`, or `quantization="fp8"` online).

The names are `minivllm.quantization_config.LINEAR_QUANTIZATION_METHODS`; each format's `QuantizationConfig`
gives every linear layer its `LinearMethod` (base.py).
"""

from __future__ import annotations

from minivllm.config import ModelConfig
from minivllm.quantization_config import LINEAR_QUANTIZATION_METHODS
from minivllm.worker.layers.quantization.awq import AwqConfig
from minivllm.worker.layers.quantization.base import QuantizationConfig
from minivllm.worker.layers.quantization.compressed_tensors import CompressedTensorsConfig
from minivllm.worker.layers.quantization.fp8 import Fp8Config
from minivllm.worker.layers.quantization.gptq import GptqConfig

QUANTIZATION_CONFIGS: dict[str, type[QuantizationConfig]] = {
    cls.name: cls for cls in (Fp8Config, CompressedTensorsConfig, AwqConfig, GptqConfig)
}
assert tuple(QUANTIZATION_CONFIGS) == LINEAR_QUANTIZATION_METHODS


def get_quantization_config(config: ModelConfig) -> QuantizationConfig | None:
    """The model's quantization: the checkpoint's `quantization_config`, or online fp8 for a
    16-bit checkpoint loaded with quantization="fp8"; None for neither."""
    if config.quantization is None:
        return None
    declared = config.hf_config.get("quantization_config")
    if declared is None:  # EngineArgs allows this for fp8 only
        return Fp8Config.online()
    return QUANTIZATION_CONFIGS[config.quantization].from_config(declared)
