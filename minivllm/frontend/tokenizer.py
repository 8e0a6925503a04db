"""Loading the HF tokenizer the frontend works with."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from minivllm.gguf_file import pretrained_args
from minivllm.hf_imports import from_transformers

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase as Tokenizer
else:
    Tokenizer = Any  # transformers loads with the first tokenizer: it takes seconds to import


def load_tokenizer(path: str, *, trust_remote_code: bool = False) -> Tokenizer:
    """Load the fast (Rust `tokenizers`-backed) tokenizer in `path`: an HF directory, or a
    GGUF file's own vocabulary (transformers builds it from the file's metadata).

    Only fast tokenizers are accepted: incremental detokenization steps the Rust
    tokenizer directly (`tokenizers.decoders.DecodeStream`).
    """
    AutoTokenizer = from_transformers("", "AutoTokenizer")
    name, kwargs = pretrained_args(path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            name, use_fast=True, trust_remote_code=trust_remote_code, **kwargs
        )
    except (OSError, ValueError, KeyError) as e:
        if not kwargs:
            raise ValueError(f"tokenizer: cannot load one from {path!r}: {e}") from e
        raise ValueError(
            f"tokenizer: cannot build one from the GGUF file {path!r} ({e}); pass tokenizer= "
            "the model's HF tokenizer directory"
        ) from e
    if not tokenizer.is_fast:
        raise ValueError(
            f"tokenizer: {path!r} has no fast (tokenizers) version, which mini-vllm needs"
        )
    return tokenizer


def load_tokenizer_meanwhile(path: str | None) -> Future[Tokenizer | None]:
    """Start loading the tokenizer at `path` (None: no tokenizer) in a thread and return its
    future: transformers' import and the load take seconds, which then pass while the
    engine-core starts instead of before it."""
    future: Future[Tokenizer | None] = Future()
    if path is None:
        future.set_result(None)
        return future

    def load() -> None:
        try:
            future.set_result(load_tokenizer(path))
        except BaseException as e:
            future.set_exception(e)

    threading.Thread(target=load, name="tokenizer-load", daemon=True).start()
    return future


def resolve_tokenizer(
    given: Tokenizer | Future[Tokenizer | None] | None, path: str, skip: bool
) -> Tokenizer | None:
    """The frontend's tokenizer: `given`, or its loading finished, or (None, unless `skip`)
    loaded from `path` now."""
    if isinstance(given, Future):
        return given.result()
    if given is None and not skip:
        return load_tokenizer(path)
    return given
