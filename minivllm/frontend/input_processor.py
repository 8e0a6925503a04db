"""From a user's prompt to a validated `EngineCoreRequest`: tokenize, check, cap, name."""

from __future__ import annotations

import itertools
import json
import numbers
import secrets
import time
from typing import Any

import msgspec

from minivllm.config import ModelConfig
from minivllm.frontend.tokenizer import Tokenizer
from minivllm.protocol.limits import MAX_USER_REQUEST_ID_CHARS
from minivllm.protocol.messages import EngineCoreRequest
from minivllm.protocol.sampling_params import SamplingParams
from minivllm.protocol.structured_outputs import StructuredOutputsParams

# what `LLM.generate` accepts as one prompt, as in vLLM: text, token ids, or a dict of either
PromptType = str | list[int] | dict[str, Any]


class InputProcessor:
    """Turns prompts into engine-core requests; every bad input is a `ValueError` that names
    the parameter at fault, raised before anything reaches the engine."""

    def __init__(self, model_config: ModelConfig, tokenizer: Tokenizer | None) -> None:
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.max_model_len = model_config.max_model_len
        # The model's vocabulary may be padded past the tokenizer's and vice versa (Qwen);
        # an id is out of range only if both reject it (len: added tokens included).
        self.max_token_id = model_config.vocab_size - 1
        if tokenizer is not None:
            self.max_token_id = max(self.max_token_id, len(tokenizer) - 1)
        eos = list(model_config.eos_token_ids)
        if not eos and tokenizer is not None and tokenizer.eos_token_id is not None:
            eos = [tokenizer.eos_token_id]
        self.eos_token_ids = eos
        # Internal ids must be unique per engine, and several frontends may share one
        # engine-core: a random salt per frontend plus a counter makes them so.
        self._salt = secrets.token_hex(4)
        self._counter = itertools.count()

    def make_internal_id(self, user_request_id: str) -> str:
        """An engine-internal id for `user_request_id`; the user may reuse their id, this never
        repeats. The part after the last '-' is unique, so no two ids can collide."""
        return f"{user_request_id}-{self._salt}{next(self._counter):x}"

    def process(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> tuple[str | None, EngineCoreRequest]:
        """Validate and tokenize one prompt for the user's `request_id`.

        `prompt` is a str, `{"prompt": str}`, `{"prompt_token_ids": [...]}` (optionally with
        the "prompt" text it came from) or a list of ints. Returns the prompt text (None if
        only ids were given) and the request, whose `request_id` is a fresh internal id and
        whose `max_tokens` is capped to what fits in `max_model_len`.
        """
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        if not isinstance(request_id, str) or len(request_id) > MAX_USER_REQUEST_ID_CHARS:
            raise ValueError(
                f"request_id must be a str of at most {MAX_USER_REQUEST_ID_CHARS} characters, "
                f"got {request_id!r:.80}"
            )
        prompt_text, prompt_token_ids = self._tokenize(prompt)
        self._validate_prompt(prompt_token_ids)
        self.validate_params(params)
        room = self.max_model_len - len(prompt_token_ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        min_tokens = min(params.min_tokens, max_tokens)
        params = msgspec.structs.replace(
            params,
            max_tokens=max_tokens,
            min_tokens=min_tokens,
            structured_outputs=_wire_structured_outputs(params.structured_outputs),
            _bad_words_token_ids=self._bad_words_token_ids(params.bad_words),
        )
        request = EngineCoreRequest(
            request_id=self.make_internal_id(request_id),
            prompt_token_ids=prompt_token_ids,
            sampling_params=params,
            eos_token_ids=list(self.eos_token_ids),  # the core itself honours ignore_eos
            arrival_time=time.time() if arrival_time is None else arrival_time,
        )
        return prompt_text, request

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Render a conversation with the tokenizer's (or the given) chat template;
        `template_kwargs` are passed to the template (e.g. `enable_thinking`).

        Returns a prompt dict (`{"prompt": text, "prompt_token_ids": ids}`) for `process`;
        the template already holds the special tokens, so none are added when encoding.
        """
        if self.tokenizer is None:
            raise ValueError("messages: chat needs a tokenizer, but skip_tokenizer_init=True")
        if not isinstance(messages, list) or not all(
            isinstance(m, dict) and "role" in m and "content" in m for m in messages
        ):
            raise ValueError(
                f"messages must be a list of {{'role': ..., 'content': ...}} dicts, got {messages!r}"
            )
        text = self.tokenizer.apply_chat_template(
            messages,
            chat_template=chat_template,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
            **(template_kwargs or {}),
        )
        return {
            "prompt": text,
            "prompt_token_ids": self.tokenizer.encode(text, add_special_tokens=False),
        }

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), _as_token_ids(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return prompt["prompt"], self._encode(prompt["prompt"])
            raise ValueError(
                f"prompt: a dict prompt needs 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}"
            )
        if isinstance(prompt, str):
            return prompt, self._encode(prompt)
        if isinstance(prompt, list):
            return None, _as_token_ids(prompt)
        raise ValueError(
            f"prompt must be a str, a list of token ids or a dict, got {type(prompt).__name__}"
        )

    def _encode(self, text: Any) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"prompt must be a str, got {type(text).__name__}")
        if self.tokenizer is None:
            raise ValueError(
                "prompt: a text prompt needs a tokenizer, but skip_tokenizer_init=True; "
                "pass prompt_token_ids instead"
            )
        return self.tokenizer.encode(text)

    def _validate_prompt(self, prompt_token_ids: list[int]) -> None:
        if not prompt_token_ids:
            raise ValueError("prompt: the decoder prompt cannot be empty")
        bad = None  # min/max first: one pass each in C, the per-id scan only for the error
        if min(prompt_token_ids) < 0 or max(prompt_token_ids) > self.max_token_id:
            bad = next(t for t in prompt_token_ids if not 0 <= t <= self.max_token_id)
        if bad is not None:
            raise ValueError(
                f"prompt_token_ids: token id {bad} is out of vocabulary "
                f"(valid ids are 0..{self.max_token_id})"
            )
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(
                f"The decoder prompt (length {len(prompt_token_ids)}) is longer than the maximum "
                f"model length of {self.max_model_len}. Make sure that `max_model_len` is larger "
                "than the prompt length, so at least one token can be generated."
            )

    def validate_params(self, params: SamplingParams) -> None:
        """The checks of `params` that need the model or the tokenizer (`process` makes
        them too; a server makes them before it starts a stream)."""
        vocab = self.model_config.vocab_size
        max_logprobs = self.model_config.max_logprobs
        if max_logprobs == -1:
            max_logprobs = vocab
        for name, what in (("logprobs", "sample"), ("prompt_logprobs", "prompt")):
            num = getattr(params, name)
            num = vocab if num == -1 else num
            if num and num > max_logprobs:
                raise ValueError(
                    f"{name}: Requested {what} logprobs of {num}, which is greater than max "
                    f"allowed: {max_logprobs}"
                )
        bad = [t for t in params.logit_bias or () if not 0 <= t < vocab]
        if bad:
            raise ValueError(
                f"token_id(s) {bad} in logit_bias contain out-of-vocab token ids. "
                f"Vocabulary size: {vocab}"
            )
        bad = [t for t in params.allowed_token_ids or () if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"allowed_token_ids contains out-of-vocab token id! ({bad})")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop: stop strings need a tokenizer, but skip_tokenizer_init=True")
        bad = next((t for t in params.stop_token_ids or [] if t > self.max_token_id), None)
        if bad is not None:
            raise ValueError(
                f"stop_token_ids: token id {bad} is out of vocabulary "
                f"(valid ids are 0..{self.max_token_id})"
            )
        if params.structured_outputs is not None:
            if self.tokenizer is None:
                raise ValueError(
                    "structured_outputs need a tokenizer, but skip_tokenizer_init=True"
                )
            from minivllm.engine_core.structured_output.grammar import check

            check(params.structured_outputs)

    def _bad_words_token_ids(self, bad_words: list[str] | None) -> list[list[int]] | None:
        """The token sequences `bad_words` forbids, as vLLM finds them: each word without a
        leading space, and with one when that gives a different first token and as many
        tokens (the form it takes inside a sentence)."""
        if not bad_words:
            return None
        if self.tokenizer is None:
            raise ValueError("bad_words need a tokenizer, but skip_tokenizer_init=True")
        sequences: list[list[int]] = []
        for word in bad_words:
            bare = self.tokenizer.encode(word.lstrip(), add_special_tokens=False)
            if not bare:
                raise ValueError("bad_words entries must tokenize to at least one token.")
            sequences.append(bare)
            spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
                sequences.append(spaced)
        bad = [t for ids in sequences for t in ids if not 0 <= t <= self.max_token_id]
        if bad:
            raise ValueError(
                f"bad_words: the model vocabulary size is {self.max_token_id + 1}, but the "
                f"following tokens were specified as bad: {bad}"
            )
        return sequences


def _wire_structured_outputs(
    params: StructuredOutputsParams | None,
) -> StructuredOutputsParams | None:
    """A schema given as a dict travels as its JSON text."""
    if params is None or not isinstance(params.json, dict):
        return params
    return msgspec.structs.replace(params, json=json.dumps(params.json))


def _as_token_ids(ids: Any) -> list[int]:
    # a fresh list of plain ints: numpy ids are fine, and later edits by the caller are not seen
    if isinstance(ids, (list, tuple)):
        # plain ints first: the ABC check costs ~2 µs an id (0.5 s for 256 prompts of 2k ids)
        if all(type(t) is int for t in ids):
            return list(ids)
        if all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in ids):
            return [int(t) for t in ids]
    raise ValueError(f"prompt_token_ids must be a list of ints, got {ids!r:.80}")
