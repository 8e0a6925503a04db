"""The model as a daemon's clients know it: from the handshake, so a client needs no copy of
the model, on this host or another.

The daemon sends its `ModelConfig` (name, limits, vocabulary, EOS ids, sampling defaults)
and, to a client without a tokenizer of its own, the tokenizer's files as `save_pretrained`
writes them. The client decodes the config as that dataclass, writes the files it knows by
name (never a path it was sent) into a private temporary directory, loads the tokenizer
from there and removes the directory.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile

import msgspec

from minivllm import generation_defaults
from minivllm.config import ModelConfig
from minivllm.exceptions import EngineStartupError
from minivllm.frontend.tokenizer import Tokenizer, load_tokenizer
from minivllm.protocol.limits import MAX_TOKENIZER_BYTES, MAX_TOKENIZER_FILES
from minivllm.protocol.messages import EngineCoreInfo, TokenizerFile

logger = logging.getLogger(__name__)

# the files `save_pretrained` writes for a fast tokenizer (and a few older spellings)
TOKENIZER_FILE_NAMES = frozenset(
    {
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "added_tokens.json",
        "chat_template.jinja",
        "chat_template.json",
        "vocab.json",
        "merges.txt",
        "vocab.txt",
        "tokenizer.model",
    }
)


def tokenizer_files(model_config: ModelConfig) -> list[TokenizerFile] | None:
    """The daemon's side: its tokenizer as files for the handshake; None (with a warning
    that clients must bring their own) when it has none or it is over the size limit."""
    if model_config.skip_tokenizer_init:
        return None
    try:
        tokenizer = load_tokenizer(model_config.tokenizer)
    except Exception as e:  # the engine runs without one; its clients bring their own
        logger.warning(
            "no tokenizer to hand clients (%s): they must load their own "
            "(connect(..., tokenizer=DIR))",
            e,
        )
        return None
    with tempfile.TemporaryDirectory(prefix="minivllm-tokenizer-") as out:
        tokenizer.save_pretrained(out)
        names = sorted(n for n in os.listdir(out) if n in TOKENIZER_FILE_NAMES)
        files = []
        for name in names[:MAX_TOKENIZER_FILES]:
            with open(os.path.join(out, name), "rb") as f:
                files.append(TokenizerFile(name, f.read()))
    size = sum(len(f.data) for f in files)
    if size > MAX_TOKENIZER_BYTES:
        logger.warning(
            "the tokenizer's files (%d bytes) are over the handshake's %d-byte limit: clients "
            "must load their own (connect(..., tokenizer=DIR))",
            size,
            MAX_TOKENIZER_BYTES,
        )
        return None
    return files


def attached_model(
    info: EngineCoreInfo, address: str, tokenizer: str | None = None
) -> tuple[ModelConfig, Tokenizer | None]:
    """The client's side: the engine's `ModelConfig` and the tokenizer to use with it —
    `tokenizer` (a directory) when given, else the one the engine-core sent."""
    try:
        config = msgspec.msgpack.decode(info.model_config, type=ModelConfig)
    except msgspec.DecodeError as e:
        raise EngineStartupError(
            f"the engine-core at {address} sent a model config that does not decode: {e}"
        ) from None
    generation_defaults.log_defaults(config.generation_config, config.default_sampling_params)
    if config.skip_tokenizer_init:
        return config, None
    if tokenizer is not None:
        return config, load_tokenizer(tokenizer)
    if not info.tokenizer_files:
        raise EngineStartupError(
            f"the engine-core at {address} sent no tokenizer (its tokenizer is over the "
            f"handshake's {MAX_TOKENIZER_BYTES >> 20} MiB): pass tokenizer=DIR to connect"
        )
    return config, _load_sent_tokenizer(info.tokenizer_files, address)


def _load_sent_tokenizer(files: list[TokenizerFile], address: str) -> Tokenizer:
    unknown = sorted(f.name for f in files if f.name not in TOKENIZER_FILE_NAMES)
    if unknown:
        raise EngineStartupError(
            f"the engine-core at {address} sent tokenizer files of unknown names: {unknown}"
        )
    directory = tempfile.mkdtemp(prefix="minivllm-tokenizer-")
    try:
        for f in files:
            with open(os.path.join(directory, f.name), "wb") as out:
                out.write(f.data)
        return load_tokenizer(directory)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
