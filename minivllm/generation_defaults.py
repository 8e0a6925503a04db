"""The model's sampling defaults, as vLLM takes them (`--generation-config auto|vllm|DIR`).

With "auto" (the default) the sampling fields of the model's `generation_config.json`
(of its `config.json` when it has none) are the defaults of every request that leaves them
unset; "vllm" ignores them (vLLM's neutral defaults); a directory reads its
`generation_config.json` instead of the model's. HF's `max_new_tokens` becomes `max_tokens`.
Where "unset" is decided differs by API, as in vLLM: `LLM.generate` without sampling params
uses `LLM.get_default_sampling_params()`; the server fills each field the request leaves
out (`frontend/server/sampling.py`).
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

logger = logging.getLogger(__name__)

GENERATION_CONFIG_SOURCES = ("auto", "vllm")  # or a directory holding generation_config.json
# the generation-config fields vLLM takes as sampling defaults, in vLLM's order
SAMPLING_KEYS = (
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "max_new_tokens",
)
_logged: set[str] = set()


def check_source(source: str) -> None:
    """ValueError unless `source` is "auto", "vllm" or a directory."""
    if source not in GENERATION_CONFIG_SOURCES and not os.path.isdir(source):
        raise ValueError(
            f"generation_config must be 'auto', 'vllm' or a directory holding "
            f"generation_config.json, got {source!r}"
        )


def read_generation_config(directory: str, hf_config: dict[str, Any] | None) -> dict[str, Any]:
    """`directory`'s generation_config.json as a dict; without one, `hf_config` (the model's
    config.json, where old checkpoints kept these fields), or {}."""
    path = os.path.join(directory, "generation_config.json")
    if os.path.isfile(path):
        with open(path) as f:
            config = json.load(f)
        if not isinstance(config, dict):
            raise ValueError(f"generation_config: {path} does not hold a JSON object")
        return config
    return dict(hf_config or {})


def default_sampling_params(
    model_dir: str,
    source: str,
    hf_config: dict[str, Any],
    overrides: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The sampling fields that differ from vLLM's neutral defaults: those the generation
    config sets (not null), after `overrides` (vLLM's `override_generation_config`)."""
    if source == "vllm":
        config: dict[str, Any] = {}
    elif source == "auto":
        config = read_generation_config(model_dir, hf_config)
    else:
        config = read_generation_config(source, None)
    config.update(overrides or {})
    defaults = {key: config[key] for key in SAMPLING_KEYS if config.get(key) is not None}
    if "max_new_tokens" in defaults:
        defaults["max_tokens"] = defaults.pop("max_new_tokens")
    return defaults


def max_tokens_cap(source: str, defaults: dict[str, Any], overrides: dict[str, Any]) -> int | None:
    """What caps even a request's own max_tokens on the server, as in vLLM: the max_new_tokens
    of a generation-config directory, or of `override_generation_config`."""
    if source not in GENERATION_CONFIG_SOURCES:
        return defaults.get("max_tokens")
    return overrides.get("max_new_tokens")


def log_defaults(source: str, defaults: dict[str, Any]) -> None:
    """vLLM's warning, once per process and setting, that the model's defaults are in force."""
    key = f"{source}:{sorted(defaults.items())}"
    if not defaults or source == "vllm" or key in _logged:
        return
    _logged.add(key)
    where = "the model's `generation_config.json`" if source == "auto" else repr(source)
    logger.warning(
        "Default sampling parameters have been overridden by %s: `%s`. If this is not "
        "intended, relaunch with `--generation-config vllm` (`generation_config='vllm'`).",
        where,
        defaults,
    )
