"""Tiny random HF checkpoints (config + safetensors + tokenizer) built locally for tests."""

from __future__ import annotations

import json
import os

import torch

from minivllm.benchmarks.null_checkpoint import NULL_ARCHITECTURE

VOCAB_SIZE = 384

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A paged KV cache stores keys and values in fixed-size blocks.",
    "Engines schedule requests, run the model, and stream tokens back to clients.",
    "Hello world! How are you today? I am fine, thank you.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000, and symbols like #, $, %, & and @.",
    "Once upon a time there was a tiny language model that generated random text.",
]

_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer(out_dir: str) -> None:
    """Train a small byte-level BPE tokenizer and save it in HF format."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - 8,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_CORPUS * 20, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        bos_token=None,
    )
    fast.chat_template = _CHAT_TEMPLATE
    fast.save_pretrained(out_dir)


_ARCHS = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
}
# the mixtures' expert geometry unless a test sets its own: top-4 of 16 experts for Qwen3-MoE,
# Mixtral's top-2 of 8
_MOE_DEFAULTS: dict[str, dict[str, object]] = {
    "qwen3_moe": dict(
        num_experts=16, num_experts_per_tok=4, moe_intermediate_size=32, norm_topk_prob=True
    ),
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2),
}


def build_checkpoint(
    out_dir: str,
    arch: str = "qwen3",
    *,
    tie_word_embeddings: bool = True,
    num_layers: int = 2,
    hidden_size: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    intermediate_size: int = 128,
    max_position_embeddings: int = 512,
    max_shard_size: str | None = None,
    eos_token_ids: list[int] | None = None,
    seed: int = 0,
    **extra_config: object,
) -> str:
    """Save a random tiny model of `arch` (plus tokenizer and generation config) to out_dir;
    `extra_config` goes into its config (e.g. Llama's attention_bias, `rope_scaling`, Phi-3's
    partial_rotary_factor). Phi-3 has no head_dim: hidden_size / num_heads."""
    import transformers

    config_cls_name, model_cls_name = _ARCHS[arch]
    config_cls = getattr(transformers, config_cls_name)
    model_cls = getattr(transformers, model_cls_name)
    kwargs = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        eos_token_id=0,
        bos_token_id=None,
        pad_token_id=0,
    )
    if arch in (
        "qwen3",
        "llama",
        "mistral",
        "qwen3_moe",
        "mixtral",
    ):  # Phi-3: hidden_size / num_heads
        kwargs["head_dim"] = head_dim
    if arch in ("mistral", "mixtral"):
        kwargs["sliding_window"] = None
    config = config_cls(**kwargs, **{**_MOE_DEFAULTS.get(arch, {}), **extra_config})
    config.dtype = "float32"
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():
        # larger-than-default weights so greedy decoding is not a constant token
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.2)
    os.makedirs(out_dir, exist_ok=True)
    save_kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out_dir, safe_serialization=True, **save_kwargs)
    build_tokenizer(out_dir)
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": eos_token_ids if eos_token_ids is not None else [0]}, f)
    return out_dir


LONGROPE_ORIGINAL_LEN = 64  # where the tiny LongRoPE checkpoint switches to its long factors


def longrope_scaling(rotary_dim: int, seed: int) -> dict[str, object]:
    """Phi-3's LongRoPE rope_scaling with random factors: short ones near 1, long ones far
    from them, so that rotating with the wrong set changes the tokens."""
    gen = torch.Generator().manual_seed(seed)
    n = rotary_dim // 2
    return {
        "rope_type": "longrope",
        "short_factor": (1 + 0.5 * torch.rand(n, generator=gen)).tolist(),
        "long_factor": (1 + 7 * torch.rand(n, generator=gen)).tolist(),
    }


def build_null_checkpoint(out_dir: str, **extra_config: object) -> str:
    """A config.json for the null model (no weights) plus the tiny tokenizer. The null model
    is registered in every process of the tests (tests/conftest.py)."""
    os.makedirs(out_dir, exist_ok=True)
    config = {
        "architectures": [NULL_ARCHITECTURE],
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 8,
        "num_hidden_layers": 1,
        "num_attention_heads": 1,
        "num_key_value_heads": 1,
        "head_dim": 8,
        "max_position_embeddings": 4096,
        "eos_token_id": 0,
        "torch_dtype": "float32",
        **extra_config,
    }
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f)
    build_tokenizer(out_dir)
    return out_dir
