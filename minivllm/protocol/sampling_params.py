"""Sampling parameters: vLLM's names and defaults, validated on construction."""

from __future__ import annotations

import enum

import msgspec

from minivllm.protocol.limits import (
    MAX_N,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    StopStrings,
    StopTokenIds,
)

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

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.top_k == -1:
            self.top_k = 0
        self._validate()
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
        if self.stop is not None and not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        if self.stop_token_ids is not None and not all(
            isinstance(t, int) and t >= 0 for t in self.stop_token_ids
        ):
            raise ValueError(
                f"stop_token_ids must be a list of non-negative integers, got {self.stop_token_ids!r}"
            )

    def _validate_sizes(self) -> None:
        """The bounds a receiver enforces on decode (limits.py), as errors for the user."""
        if self.n > MAX_N:
            raise ValueError(f"n must be at most {MAX_N}, got {self.n}")
        if self.stop is not None:
            if len(self.stop) > MAX_STOP_STRINGS:
                raise ValueError(
                    f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}"
                )
            longest = max((len(s) for s in self.stop), default=0)
            if longest > MAX_STOP_STRING_CHARS:
                raise ValueError(
                    f"stop: a stop string may have at most {MAX_STOP_STRING_CHARS} characters, "
                    f"got one of {longest}"
                )
        if self.stop_token_ids is not None and len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(
                f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS} ids, got {len(self.stop_token_ids)}"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    def clone(self) -> SamplingParams:
        return msgspec.structs.replace(self)
