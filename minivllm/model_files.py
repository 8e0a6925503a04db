"""What the engine config reads of a model's files: its HF config (a directory's config.json,
a multimodal checkpoint's flattened to its language model, or a GGUF file's metadata), its
EOS ids, and how its weights load."""

from __future__ import annotations

import json
import os
from typing import Any

from minivllm.gguf_file import gguf_hf_config, is_gguf_path
from minivllm.language_model_config import language_model_config


def _read_json(path: str) -> dict[str, Any]:
    with open(path) as f:
        return json.load(f)


def read_hf_config(model: str) -> dict[str, Any]:
    """The HF config of `model`: its directory's config.json (a multimodal checkpoint whose
    language model is served alone: that model's config), or a GGUF file's metadata."""
    if is_gguf_path(model):
        return gguf_hf_config(model)
    config_path = os.path.join(model, "config.json")
    if not os.path.isfile(config_path):
        raise ValueError(f"model: no config.json in {model!r}")
    return language_model_config(_read_json(config_path))


def resolve_load_format(model: str, load_format: str, quantization: str | None) -> str:
    """A GGUF file loads as "gguf" under "auto" (as in vLLM; "dummy" still means random
    weights of its geometry); "gguf", as load_format or quantization, needs one."""
    gguf = is_gguf_path(model)
    for name, value in (("load_format", load_format), ("quantization", quantization)):
        if value == "gguf" and not gguf:
            raise ValueError(f"{name}='gguf' needs model to be a GGUF file, got {model!r}")
    if gguf and quantization not in (None, "gguf"):
        raise ValueError(f"quantization={quantization!r}: a GGUF file's quantization is 'gguf'")
    return "gguf" if gguf and load_format == "auto" else load_format


def eos_ids(model_dir: str, hf_config: dict[str, Any]) -> tuple[int, ...]:
    """generation_config.json's EOS ids, else config.json's."""
    gen_path = os.path.join(model_dir, "generation_config.json")
    eos: Any = None
    if os.path.isfile(gen_path):
        eos = _read_json(gen_path).get("eos_token_id")
    if eos is None:
        eos = hf_config.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)
