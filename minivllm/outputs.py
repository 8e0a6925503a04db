"""What `LLM.generate` and `AsyncLLM.generate` return: vLLM's `RequestOutput` and
`CompletionOutput`, with the same fields, meanings and reprs. Slotted: the frontend makes
one of each per request per step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class Logprob:
    """The log probability of one token at one position, its rank among all tokens (1 = the
    most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# one dict per position: the chosen (sampled or prompt) token first, then the top-k
SampleLogprobs = list[dict[int, Logprob]]
# the first prompt token has no logprob: its entry is None
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass(slots=True)
class CompletionOutput:
    """One completion (of `n`) of a request.

    `text` and `token_ids` hold everything so far, or only the new part for
    `RequestOutputKind.DELTA`. `finish_reason` is None while running, else 'stop', 'length',
    'abort' or 'error'; `stop_reason` is the stop string or stop token id that ended it
    (None for EOS and for the other reasons).
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None  # the sum of the sampled tokens' logprobs
    logprobs: SampleLogprobs | None = None  # when SamplingParams.logprobs was given
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None

    def __repr__(self) -> str:
        return (
            f"CompletionOutput(index={self.index}, text={self.text!r}, "
            f"token_ids={self.token_ids}, cumulative_logprob={self.cumulative_logprob}, "
            f"logprobs={self.logprobs}, finish_reason={self.finish_reason}, "
            f"stop_reason={self.stop_reason})"
        )


@dataclass(slots=True)
class RequestOutput:
    """The state of one user request: its prompt and its `n` completions.

    `request_id` is the id the user gave (not the engine-internal one). `finished` is True
    once every completion has finished; `num_cached_tokens` counts prompt tokens served
    from the prefix cache. `prompt_logprobs` arrive whole with the first output (DELTA: only
    then).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int | None = None
    metrics: Any = None
    prompt_logprobs: PromptLogprobs | None = None  # when SamplingParams.prompt_logprobs was given

    def __repr__(self) -> str:
        return (
            f"RequestOutput(request_id={self.request_id}, prompt={self.prompt!r}, "
            f"prompt_token_ids={self.prompt_token_ids}, "
            f"prompt_logprobs={self.prompt_logprobs}, outputs={self.outputs}, "
            f"finished={self.finished}, metrics={self.metrics}, "
            f"num_cached_tokens={self.num_cached_tokens})"
        )
