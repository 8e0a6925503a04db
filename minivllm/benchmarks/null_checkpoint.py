"""A model directory for the null model (no forward pass) with a real BPE tokenizer, so an
engine run measures everything around the model, detokenization included; and the null
model's registration, which this module makes (the model is no part of the engine: the
engine loads it as any model from outside the package, through `ModelRegistry`).

A process started on its own (`minivllm serve DIR`, `minivllm engine-core --model DIR`)
registers it as a plugin, `NULL_MODEL_PLUGIN` in MINIVLLM_PLUGINS (`null_model_env`)."""

from __future__ import annotations

import importlib
import inspect
import json
import os
from collections.abc import Mapping

from minivllm.model_registry import ModelRegistry

NULL_ARCHITECTURE = "MiniVllmNullForCausalLM"
NULL_MODEL_PLUGIN = "minivllm.benchmarks.null_checkpoint:register_null_model"
NULL_VOCAB_SIZE = 4096
_CORPUS_MODULES = ("argparse", "json.decoder", "textwrap", "string", "difflib", "pprint")


def register_null_model() -> None:
    """config.json's `architectures: ["MiniVllmNullForCausalLM"]` loads the null model."""
    ModelRegistry.register_model(
        NULL_ARCHITECTURE, "minivllm.benchmarks.null_model:NullForCausalLM"
    )


def null_model_env(env: Mapping[str, str]) -> dict[str, str]:
    """`env` with the null model's plugin added to its MINIVLLM_PLUGINS: the environment of a
    process started on its own (a `minivllm` command) that is to load the null model."""
    plugins = [p for p in env.get("MINIVLLM_PLUGINS", "").split(",") if p]
    return {**env, "MINIVLLM_PLUGINS": ",".join([*plugins, NULL_MODEL_PLUGIN])}


def train_tokenizer(out_dir: str, vocab_size: int = NULL_VOCAB_SIZE) -> int:
    """Train a byte-level BPE tokenizer on stdlib sources, save it in HF format to out_dir
    and return its vocabulary size. Stdlib sources are English prose and code, fixed for a
    given Python."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    os.makedirs(out_dir, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = [inspect.getsource(importlib.import_module(m)) for m in _CORPUS_MODULES]
    tok.train_from_iterator(corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    fast.save_pretrained(out_dir)
    return tok.get_vocab_size()


def build_null_checkpoint(out_dir: str, vocab_size: int = NULL_VOCAB_SIZE) -> str:
    """A tokenizer (`train_tokenizer`) plus the null model's config.json with a vocabulary
    of the same size, the null model registered in this process; returns out_dir."""
    register_null_model()
    config = {
        "architectures": [NULL_ARCHITECTURE],
        "vocab_size": train_tokenizer(out_dir, vocab_size),
        # a KV cache of 16 bytes per token: the engine keeps its block bookkeeping
        "num_hidden_layers": 1,
        "hidden_size": 8,
        "num_attention_heads": 1,
        "num_key_value_heads": 1,
        "head_dim": 2,
        "max_position_embeddings": 4096,
        "torch_dtype": "float32",
        "eos_token_id": 0,
    }
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return out_dir
