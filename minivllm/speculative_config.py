"""Speculative decoding's settings: vLLM's `speculative_config`, checked into a frozen
`SpeculativeConfig`. Every error names the key it is about (`speculative_config.KEY`).

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    {"method": "draft_model", "model": "path/to/small-model", "num_speculative_tokens": 4}

`ngram` proposes the tokens that followed the latest earlier occurrence of the text's last
n tokens (prompt lookup); `draft_model` runs a smaller model of the same vocabulary in the
same workers, with a KV cache of its own.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from minivllm import rope_config
from minivllm.model_config import ModelConfig, check_moe_sharding

if TYPE_CHECKING:
    from minivllm.config import EngineArgs

SPECULATIVE_METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16  # a verification step samples at most 1 + this many rows per request
_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "model")
_NGRAM_DEFAULT = 5  # vLLM's prompt_lookup_min and _max when neither is given


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str  # one of SPECULATIVE_METHODS
    num_speculative_tokens: int  # k: the most draft tokens a step verifies per request
    prompt_lookup_min: int = 0  # ngram: the shortest suffix that counts as a match
    prompt_lookup_max: int = 0  # ngram: the longest suffix matched
    draft: ModelConfig | None = None  # draft_model: the draft model, resolved as the target is

    @property
    def num_lookahead_tokens(self) -> int:
        """KV slots a step needs past its scheduled tokens: the draft model proposes the next
        k tokens right after sampling, writing its own KV at their positions."""
        return self.num_speculative_tokens if self.method == "draft_model" else 0


def check_speculative_config(spec: Any) -> None:
    """`ValueError` naming the key if the dict cannot be a speculative config (what needs no
    files: the draft model itself is checked by `resolve_speculative_config`)."""
    _parse(spec)


def _parse(spec: Any) -> dict[str, Any]:
    """The dict's values with the defaults filled in: method, k, lookup min and max, model."""
    if not isinstance(spec, dict):
        raise ValueError(f"speculative_config must be a dict, got {type(spec).__name__}")
    unknown = sorted(set(spec) - set(_KEYS))
    if unknown:
        raise ValueError(
            f"speculative_config: unknown key(s) {unknown}; supported: {', '.join(_KEYS)}"
        )
    method, model = spec.get("method"), spec.get("model")
    if method is None:  # vLLM infers it from the model
        method = "ngram" if model in (None, "ngram", "[ngram]") else "draft_model"
    if method == "[ngram]":
        method = "ngram"
    if method not in SPECULATIVE_METHODS:
        raise ValueError(
            f"speculative_config.method must be one of {SPECULATIVE_METHODS}, got {method!r}"
        )
    k = spec.get("num_speculative_tokens")
    if not _is_int(k) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
        raise ValueError(
            "speculative_config.num_speculative_tokens must be an integer from 1 to "
            f"{MAX_SPECULATIVE_TOKENS}, got {k!r}"
        )
    low, high = spec.get("prompt_lookup_min"), spec.get("prompt_lookup_max")
    if method == "draft_model":
        for key in ("prompt_lookup_min", "prompt_lookup_max"):
            if spec.get(key) is not None:
                raise ValueError(f"speculative_config.{key} applies to method 'ngram' only")
        if not isinstance(model, str) or not model:
            raise ValueError(
                "speculative_config.model must name the draft model (a directory or a GGUF "
                f"file) for method 'draft_model', got {model!r}"
            )
        return {"method": method, "k": k, "low": 0, "high": 0, "model": model}
    if model not in (None, "ngram", "[ngram]"):
        raise ValueError("speculative_config.model: method 'ngram' uses no draft model")
    low = high if low is None else low
    high = low if high is None else high
    if low is None:
        low = high = _NGRAM_DEFAULT
    for key, value in (("prompt_lookup_min", low), ("prompt_lookup_max", high)):
        if not _is_int(value) or value < 1:
            raise ValueError(f"speculative_config.{key} must be a positive integer, got {value!r}")
    if low > high:
        raise ValueError(
            f"speculative_config.prompt_lookup_min ({low}) must be <= prompt_lookup_max ({high})"
        )
    return {"method": method, "k": k, "low": low, "high": high, "model": None}


def resolve_speculative_config(
    spec: dict[str, Any], args: EngineArgs, target: ModelConfig
) -> SpeculativeConfig:
    """The frozen config; a draft model is read like the target (same dtype, context and
    load format) and must share its vocabulary and cover its context."""
    values = _parse(spec)
    draft = None
    if values["model"] is not None:
        draft = _draft_model_config(values["model"], args, target)
    return SpeculativeConfig(values["method"], values["k"], values["low"], values["high"], draft)


def _draft_model_config(model: str, args: EngineArgs, target: ModelConfig) -> ModelConfig:
    from minivllm.config import EngineArgs as Args  # config.py imports this module

    if not os.path.exists(model):
        raise ValueError(f"speculative_config.model: no such directory or file: {model!r}")
    # dummy target weights (a benchmark geometry) give a dummy draft; else its own files
    load_format = "dummy" if target.load_format == "dummy" else "auto"
    draft_args = Args(
        model=os.path.abspath(model),  # a daemon's clients run elsewhere
        tokenizer=target.tokenizer,
        dtype=target.dtype,
        seed=args.seed,
        max_model_len=None,
        load_format=load_format,
        device=args.device,
        generation_config="vllm",
    )
    try:
        hf_config = draft_args.read_hf_config()
    except ValueError as e:
        raise ValueError(f"speculative_config.model: {e}") from None
    if int(hf_config["vocab_size"]) != target.vocab_size:
        raise ValueError(
            f"speculative_config.model: the draft's vocabulary ({hf_config['vocab_size']} "
            f"tokens) differs from the target's ({target.vocab_size}); a draft model must "
            "share the target's tokenizer"
        )
    context = rope_config.max_len_with_scaling(hf_config)
    if context < target.max_model_len:
        raise ValueError(
            f"speculative_config.model: the draft's context ({context} tokens) is shorter "
            f"than max_model_len ({target.max_model_len}); lower max_model_len"
        )
    max_len = draft_args.max_model_len = target.max_model_len
    # the workers place LongRoPE's long rows by the target's switch, for the draft as well
    draft_switch = rope_config.long_rope_threshold(hf_config, max_len)
    target_switch = rope_config.long_rope_threshold(target.hf_config, max_len)
    if draft_switch != target_switch:
        raise ValueError(
            "speculative_config.model: the draft switches to LongRoPE's long factors past "
            f"{draft_switch} tokens, the target past {target_switch}; they must agree"
        )
    tp = args.tensor_parallel_size
    try:
        config = draft_args.model_config(hf_config)
        check_moe_sharding(config, tp, args.enable_expert_parallel)
    except ValueError as e:
        raise ValueError(f"speculative_config.model: {e}") from None
    if config.num_attention_heads % tp or (config.num_kv_heads % tp and tp % config.num_kv_heads):
        raise ValueError(
            f"speculative_config.model: tensor_parallel_size ({tp}) must divide the draft's "
            f"{config.num_attention_heads} attention heads (and its {config.num_kv_heads} "
            "key/value heads divide or be divided by it)"
        )
    return config


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
