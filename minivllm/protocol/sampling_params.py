"""Sampling parameters: vLLM's names and defaults, validated on construction."""

from __future__ import annotations

import enum
import math

import msgspec

from minivllm.protocol.limits import (
    MAX_ALLOWED_TOKEN_IDS,
    MAX_BAD_WORDS,
    MAX_LOGIT_BIAS,
    MAX_N,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    AllowedTokenIds,
    BadWords,
    BadWordsTokenIds,
    LogitBias,
    StopStrings,
    StopTokenIds,
)
from minivllm.protocol.structured_outputs import StructuredOutputsParams

GREEDY_EPS = 1e-5  # a temperature below this means greedy, everywhere it is decided


class RequestOutputKind(enum.IntEnum):
    """What `AsyncLLM.generate` yields per step: everything so far, the new part, or the end only."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


class SamplingParams(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """How to sample one request. Invalid values raise `ValueError` naming the field."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: StopStrings | None = None
    stop_token_ids: StopTokenIds | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # new tokens per streamed output, the first and last excepted; raises the engine's
    # --stream-interval, never lowers it (None: the engine's)
    stream_interval: int | None = None
    presence_penalty: float = 0.0  # minus this for each token already in the output
    frequency_penalty: float = 0.0  # minus this times its count in the output, per token
    # logits of tokens in the prompt or the output: divided by this if positive, else times it
    repetition_penalty: float = 1.0
    logprobs: int | None = None  # top-k logprobs per output token (plus the sampled one); -1: all
    prompt_logprobs: int | None = None  # the same for each prompt token after the first
    logit_bias: LogitBias | None = None  # token id -> added to its logit
    allowed_token_ids: AllowedTokenIds | None = None  # only these may be sampled
    bad_words: BadWords | None = None  # never completed, with or without a leading space
    # what the text must be: a JSON schema, a regex, a choice or a grammar
    structured_outputs: StructuredOutputsParams | None = None
    # filled in by the frontend: the token ids of bad_words
    _bad_words_token_ids: BadWordsTokenIds | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.top_k == -1:
            self.top_k = 0
        if self.logprobs is True:
            self.logprobs = 1
        if self.prompt_logprobs is True:
            self.prompt_logprobs = 1
        if self.bad_words is not None:
            self.bad_words = list(dict.fromkeys(self.bad_words))
        self._validate()
        self._validate_logits_processing()
        self._validate_sizes()

    def _validate(self) -> None:
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        if not self.temperature >= 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(
                f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}"
            )
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if self.max_tokens is not None and (
            not isinstance(self.max_tokens, int) or self.max_tokens < 1
        ):
            raise ValueError(f"max_tokens must be an integer >= 1 or None, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})"
            )
        if self.stream_interval is not None and (
            not isinstance(self.stream_interval, int) or self.stream_interval < 1
        ):
            raise ValueError(
                f"stream_interval must be an integer >= 1 or None, got {self.stream_interval!r}"
            )
        if self.stop is not None and not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        if self.stop_token_ids is not None and not all(
            isinstance(t, int) and t >= 0 for t in self.stop_token_ids
        ):
            raise ValueError(
                f"stop_token_ids must be a list of non-negative integers, got {self.stop_token_ids!r}"
            )

    def _validate_logits_processing(self) -> None:
        """The fields vLLM added for logits processing, with vLLM's messages."""
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.")
        if not math.isfinite(self.repetition_penalty):
            raise ValueError(
                f"repetition_penalty must be a finite number, got {self.repetition_penalty}."
            )
        if self.repetition_penalty <= 0.0:
            raise ValueError(
                f"repetition_penalty must be greater than zero, got {self.repetition_penalty}."
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < -1):
                raise ValueError(f"{name} must be non-negative or -1, got {value}.")
        if self.logit_bias is not None and not all(
            isinstance(t, int) and math.isfinite(b) for t, b in self.logit_bias.items()
        ):
            raise ValueError(
                f"logit_bias must map integer token ids to finite numbers, got {self.logit_bias!r}"
            )
        if self.allowed_token_ids is not None:
            if len(self.allowed_token_ids) == 0:
                raise ValueError("allowed_token_ids is not None and empty!")
            if not all(isinstance(t, int) for t in self.allowed_token_ids):
                raise ValueError(
                    f"allowed_token_ids must be a list of integers, got {self.allowed_token_ids!r}"
                )
        if self.bad_words is not None and any(
            not isinstance(w, str) or not w for w in self.bad_words
        ):
            raise ValueError(
                f"bad_words cannot contain an empty string. Got bad_words={self.bad_words}"
            )
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            raise ValueError(
                "structured_outputs must be StructuredOutputsParams, got "
                f"{type(self.structured_outputs).__name__}"
            )

    @property
    def needs_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    @property
    def bad_words_token_ids(self) -> list[list[int]] | None:
        return self._bad_words_token_ids

    def _validate_sizes(self) -> None:
        """The bounds a receiver enforces on decode (limits.py), as errors for the user."""
        if self.n > MAX_N:
            raise ValueError(f"n must be at most {MAX_N}, got {self.n}")
        for name, limit in (
            ("stop", MAX_STOP_STRINGS),
            ("stop_token_ids", MAX_STOP_TOKEN_IDS),
            ("logit_bias", MAX_LOGIT_BIAS),
            ("allowed_token_ids", MAX_ALLOWED_TOKEN_IDS),
            ("bad_words", MAX_BAD_WORDS),
        ):
            value = getattr(self, name)
            if value is not None and len(value) > limit:
                raise ValueError(f"{name}: at most {limit} entries, got {len(value)}")
        for name in ("stop", "bad_words"):
            longest = max(map(len, getattr(self, name) or ()), default=0)
            if longest > MAX_STOP_STRING_CHARS:
                raise ValueError(
                    f"{name}: a string may have at most {MAX_STOP_STRING_CHARS} characters, "
                    f"got one of {longest}"
                )

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    def clone(self) -> SamplingParams:
        return msgspec.structs.replace(self)
