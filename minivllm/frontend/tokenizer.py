"""Loading the HF tokenizer, and the few things the frontend asks of it."""

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


def encode(tokenizer: Tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
    """Token ids of `text`; `add_special_tokens` adds BOS etc. (off for chat-templated text,
    which already carries them)."""
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def max_token_id(tokenizer: Tokenizer) -> int:
    """The largest id the tokenizer knows, added tokens included."""
    return len(tokenizer) - 1
