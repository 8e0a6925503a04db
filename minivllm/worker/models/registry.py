"""Architecture name (config.json "architectures"[0]) -> model class and variant: the
built-in ones here, and those registered with `ModelRegistry` (model_registry.py)."""

from __future__ import annotations

from minivllm.config import ModelConfig
from minivllm.model_registry import ModelRegistry
from minivllm.worker.models.gemma3 import Gemma3ForCausalLM, Gemma3ForConditionalGeneration
from minivllm.worker.models.llama_family import CausalLM, DecoderVariant

_GEMMA3 = DecoderVariant(
    qk_norm=True, norm_offset=True, sandwich_norms=True, tie_word_embeddings=True
)
_ARCHITECTURES: dict[str, tuple[type[CausalLM], DecoderVariant]] = {
    "LlamaForCausalLM": (CausalLM, DecoderVariant()),
    "MistralForCausalLM": (CausalLM, DecoderVariant()),
    "Qwen2ForCausalLM": (CausalLM, DecoderVariant(qkv_bias=True)),
    "Qwen3ForCausalLM": (CausalLM, DecoderVariant(qk_norm=True)),
    "Qwen3MoeForCausalLM": (CausalLM, DecoderVariant(qk_norm=True)),
    "MixtralForCausalLM": (CausalLM, DecoderVariant(norm_topk_prob=True)),
    "Gemma3ForCausalLM": (Gemma3ForCausalLM, _GEMMA3),
    # its text model, for text prompts (language_model_config.py flattens its config)
    "Gemma3ForConditionalGeneration": (Gemma3ForConditionalGeneration, _GEMMA3),
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
    model_cls, variant = _ARCHITECTURES[arch]
    return registered or model_cls, variant.for_checkpoint(config.hf_config)
