"""Loading the HF tokenizer the frontend works with."""

from __future__ import annotations

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from minivllm.gguf_file import pretrained_args

Tokenizer = PreTrainedTokenizerBase


def load_tokenizer(path: str, *, trust_remote_code: bool = False) -> Tokenizer:
    """Load the fast (Rust `tokenizers`-backed) tokenizer in `path`: an HF directory, or a
    GGUF file's own vocabulary (transformers builds it from the file's metadata).

    Only fast tokenizers are accepted: incremental detokenization steps the Rust
    tokenizer directly (`tokenizers.decoders.DecodeStream`).
    """
    name, kwargs = pretrained_args(path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            name, use_fast=True, trust_remote_code=trust_remote_code, **kwargs
        )
    except (ValueError, KeyError) as e:
        if not kwargs:
            raise
        raise ValueError(
            f"tokenizer: cannot build one from the GGUF file {path!r} ({e}); pass tokenizer= "
            "the model's HF tokenizer directory"
        ) from e
    if not tokenizer.is_fast:
        raise ValueError(
            f"tokenizer: {path!r} has no fast (tokenizers) version, which mini-vllm needs"
        )
    return tokenizer
