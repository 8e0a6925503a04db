"""Architecture name (config.json "architectures"[0]) -> model class and variant."""

from __future__ import annotations

from minivllm.config import ModelConfig
from minivllm.worker.models.llama_family import CausalLM, DecoderVariant
from minivllm.worker.models.null_model import NullForCausalLM

_ARCHITECTURES: dict[str, tuple[type[CausalLM], DecoderVariant]] = {
    "LlamaForCausalLM": (CausalLM, DecoderVariant()),
    "MistralForCausalLM": (CausalLM, DecoderVariant()),
    "Qwen2ForCausalLM": (CausalLM, DecoderVariant(qkv_bias=True)),
    "Qwen3ForCausalLM": (CausalLM, DecoderVariant(qk_norm=True)),
    "Qwen3MoeForCausalLM": (CausalLM, DecoderVariant(qk_norm=True)),
    "MixtralForCausalLM": (CausalLM, DecoderVariant(norm_topk_prob=True)),
    "MiniVllmNullForCausalLM": (NullForCausalLM, DecoderVariant()),  # benchmarks only
}


def supported_architectures() -> list[str]:
    return sorted(_ARCHITECTURES)


def resolve_architecture(config: ModelConfig) -> tuple[type[CausalLM], DecoderVariant]:
    """The model class and the variant of config's checkpoint, or ValueError naming what is
    not supported."""
    arch = config.architecture
    if arch not in _ARCHITECTURES:
        raise ValueError(
            f"architecture {arch!r} is not supported; supported: "
            f"{', '.join(supported_architectures())}"
        )
    hf = config.hf_config
    sliding = hf.get("sliding_window")
    mistral = arch in ("MistralForCausalLM", "MixtralForCausalLM")
    uses_sliding = hf.get("use_sliding_window", mistral)
    if uses_sliding and sliding and config.max_model_len > int(sliding):
        raise ValueError(
            f"{arch} uses sliding-window attention ({sliding} tokens), which is not "
            f"supported; set max_model_len <= {sliding}"
        )
    model_cls, variant = _ARCHITECTURES[arch]
    return model_cls, variant.for_checkpoint(hf)
