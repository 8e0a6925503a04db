"""Architecture name (config.json "architectures"[0]) -> model class and variant: the
built-in ones here, and those registered with `ModelRegistry` (model_registry.py)."""

from __future__ import annotations

from minivllm.config import ModelConfig
from minivllm.model_registry import ModelRegistry
from minivllm.worker.models.llama_family import CausalLM, DecoderVariant

_ARCHITECTURES: dict[str, tuple[type[CausalLM], DecoderVariant]] = {
    "LlamaForCausalLM": (CausalLM, DecoderVariant()),
    "MistralForCausalLM": (CausalLM, DecoderVariant()),
    "Qwen2ForCausalLM": (CausalLM, DecoderVariant(qkv_bias=True)),
    "Qwen3ForCausalLM": (CausalLM, DecoderVariant(qk_norm=True)),
    "Qwen3MoeForCausalLM": (CausalLM, DecoderVariant(qk_norm=True)),
    "MixtralForCausalLM": (CausalLM, DecoderVariant(norm_topk_prob=True)),
    # Phi-3 and Phi-4 (Phi-4-mini too); resid_pdrop and the other dropouts are training's
    "Phi3ForCausalLM": (CausalLM, DecoderVariant(fused_checkpoint=True)),
}


def supported_architectures() -> list[str]:
    return sorted({*_ARCHITECTURES, *ModelRegistry.registered()})


def resolve_architecture(config: ModelConfig) -> tuple[type, DecoderVariant]:
    """The model class and the variant of config's checkpoint, or ValueError naming what is
    not supported. A registered class comes first: in place of a built-in one it gets that
    one's variant; of its own architecture, the plain variant (it reads what it needs)."""
    arch = config.architecture
    registered = ModelRegistry.model_class(arch)
    if arch not in _ARCHITECTURES:
        if registered is None:
            raise ValueError(
                f"architecture {arch!r} is not supported; supported: "
                f"{', '.join(supported_architectures())}"
            )
        return registered, DecoderVariant()
    check_sliding_window(config)
    model_cls, variant = _ARCHITECTURES[arch]
    return registered or model_cls, variant.for_checkpoint(config.hf_config)


# architectures whose config's sliding_window applies without use_sliding_window (Qwen2's
# switch); Phi-3-mini-4k sets 2047, the long Phi-3 variants and Phi-4 more than they run
_SLIDING_BY_DEFAULT = ("MistralForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM")


def check_sliding_window(config: ModelConfig) -> None:
    """A sliding window changes nothing while no sequence outgrows it (max_model_len at
    most the window, as vLLM loads such a config); past that, sliding-window attention is
    not supported: ValueError naming the max_model_len that loads."""
    hf, arch = config.hf_config, config.architecture
    sliding = hf.get("sliding_window")
    uses_sliding = hf.get("use_sliding_window", arch in _SLIDING_BY_DEFAULT)
    if uses_sliding and sliding and config.max_model_len > int(sliding):
        raise ValueError(
            f"{arch} uses sliding-window attention ({sliding} tokens), which is not "
            f"supported; set max_model_len <= {sliding}"
        )
