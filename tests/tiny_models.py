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
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
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
    if arch in ("qwen3", "llama", "mistral", "gemma3", "qwen3_moe", "mixtral"):
        kwargs["head_dim"] = head_dim  # Phi-3: hidden_size / num_heads
    if arch in ("mistral", "mixtral"):
        kwargs["sliding_window"] = extra_config.pop("sliding_window", None)
    config = config_cls(**kwargs, **{**_MOE_DEFAULTS.get(arch, {}), **extra_config})
    config.dtype = "float32"
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():
        # larger-than-default weights so greedy decoding is not a constant token
        # (and Gemma's norms, whose weight starts at its offset 0: so that the offset counts)
        for p in model.parameters():
            if p.dim() > 1 or arch == "gemma3":
                p.normal_(0.0, 0.2)
        if arch == "gemma3":  # scaled by sqrt(hidden): as large as the other models' after it
            model.model.embed_tokens.weight.normal_(0.0, 0.2 / hidden_size**0.5)
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


def build_window_checkpoints(root: str) -> dict[str, str]:
    """Tiny checkpoints with sliding windows of 8 tokens, shorter than most test prompts:
    gemma3 (sliding, global, sliding layers; its own attention scale, local RoPE base,
    linear RoPE scaling on the global layer, logit soft-capping), gemma3-pattern (the same
    model family in the older config layout: `sliding_window_pattern`, `rope_theta` +
    `rope_local_base_freq`, tied embeddings left to the default), mistral-window (every
    layer windowed, so the engine frees the blocks behind the window), mixtral-window (the
    same, with routed experts), phi3-window (the same, with Phi-3's fused checkpoint and
    partial rotary) and qwen2-window (`use_sliding_window` from `max_window_layers` on)."""
    gemma = dict(
        num_layers=3,
        sliding_window=8,
        query_pre_attn_scalar=24,
        rope_local_base_freq=1000.0,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
        final_logit_softcapping=5.0,
    )
    paths = {
        "gemma3": build_checkpoint(
            os.path.join(root, "gemma3"),
            "gemma3",
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            seed=4,
            **gemma,
        ),
        "gemma3-pattern": build_checkpoint(
            os.path.join(root, "gemma3-pattern"), "gemma3", seed=5, **{**gemma, "num_layers": 4}
        ),
        "mistral-window": build_checkpoint(
            os.path.join(root, "mistral-window"), "mistral", seed=6, sliding_window=8
        ),
        "mixtral-window": build_checkpoint(
            os.path.join(root, "mixtral-window"), "mixtral", seed=9, sliding_window=8
        ),
        "phi3-window": build_checkpoint(
            os.path.join(root, "phi3-window"),
            "phi3",
            seed=8,
            hidden_size=96,
            partial_rotary_factor=0.75,
            sliding_window=8,
        ),  # fmt: skip
        "qwen2-window": build_checkpoint(  # layer 0 global, layer 1 windowed
            os.path.join(root, "qwen2-window"),
            "qwen2",
            seed=7,
            tie_word_embeddings=False,
            use_sliding_window=True,
            sliding_window=8,
            max_window_layers=1,
        ),  # fmt: skip
    }
    # as Gemma 3 checkpoints on the Hub write it: global layer every 2nd (layers 1 and 3)
    _rewrite_config(
        paths["gemma3-pattern"],
        drop=("layer_types", "_sliding_window_pattern", "rope_parameters", "tie_word_embeddings"),
        sliding_window_pattern=2,
        rope_theta=10000.0,
        rope_local_base_freq=1000.0,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
    )
    return paths


def build_gemma3_multimodal(out_dir: str, hub_layout: bool = False, seed: int = 7) -> str:
    """A tiny Gemma3ForConditionalGeneration (a one-layer vision tower beside a Gemma 3 text
    model with an 8-token window). `hub_layout`: the text model's weights named
    `model.language_model.*` and its config written as the Hub's Gemma 3 checkpoints write
    it, only the settings that differ from transformers' defaults."""
    import transformers
    from safetensors.torch import load_file, save_file

    text = transformers.Gemma3TextConfig(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        sliding_window=8, sliding_window_pattern=3, rms_norm_eps=1e-6, eos_token_id=0,
        pad_token_id=0, bos_token_id=None,
    )  # fmt: skip
    vision = transformers.SiglipVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        image_size=28, patch_size=14,
    )  # fmt: skip
    config = transformers.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=383,
        boi_token_index=381, eoi_token_index=382, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    config.dtype = "float32"
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
        model.get_input_embeddings().weight.normal_(0.0, 0.2 / 64**0.5)
    model.save_pretrained(out_dir, safe_serialization=True)
    build_tokenizer(out_dir)
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [0]}, f)
    if hub_layout:
        path = os.path.join(out_dir, "model.safetensors")
        weights = load_file(path)
        prefix = "language_model.model."
        renamed = {
            "model.language_model." + k[len(prefix) :] if k.startswith(prefix) else k: v
            for k, v in weights.items()
        }
        save_file(renamed, path, metadata={"format": "pt"})
        defaults = transformers.Gemma3TextConfig().to_dict()
        with open(os.path.join(out_dir, "config.json")) as f:
            saved = json.load(f)
        saved["text_config"] = {
            k: v
            for k, v in saved["text_config"].items()
            if k == "model_type" or k not in defaults or defaults[k] != v
        }
        saved["text_config"].pop("layer_types")  # the pattern instead, as 2025's configs
        with open(os.path.join(out_dir, "config.json"), "w") as f:
            json.dump(saved, f, indent=2)
    return out_dir


def _rewrite_config(path: str, drop: tuple[str, ...] = (), **values: object) -> None:
    config_path = os.path.join(path, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    config = {k: v for k, v in config.items() if k not in drop}
    with open(config_path, "w") as f:
        json.dump({**config, **values}, f, indent=2)


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
