"""Loading the HF tokenizer the frontend works with."""

from __future__ import annotations

from transformers import AutoTokenizer, PreTrainedTokenizerBase

Tokenizer = PreTrainedTokenizerBase


def load_tokenizer(path: str, *, trust_remote_code: bool = False) -> Tokenizer:
    """Load the fast (Rust `tokenizers`-backed) tokenizer in `path`.

    Only fast tokenizers are accepted: incremental detokenization steps the Rust
    tokenizer directly (`tokenizers.decoders.DecodeStream`).
    """
    tokenizer = AutoTokenizer.from_pretrained(
        path, use_fast=True, trust_remote_code=trust_remote_code
    )
    if not tokenizer.is_fast:
        raise ValueError(
            f"tokenizer: {path!r} has no fast (tokenizers) version, which mini-vllm needs"
        )
    return tokenizer
