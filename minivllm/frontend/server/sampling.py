"""Request fields -> `SamplingParams`, with vLLM's names. A field reaches SamplingParams
when the client sent it, else the model's default (its generation config, as vLLM applies
it: `ServerDefaults`), else SamplingParams' own default."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from minivllm import generation_defaults
from minivllm.config import ModelConfig
from minivllm.frontend.server.errors import OpenAIError, from_value_error
from minivllm.frontend.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
)
from minivllm.protocol.sampling_params import RequestOutputKind, SamplingParams
from minivllm.protocol.structured_outputs import StructuredOutputsParams

_FIELDS = frozenset(SamplingParams.__struct_fields__)
# the request fields SamplingParams has too, passed on when not None (for most: when sent);
# the others are converted below
_PASSED = sorted(
    (set(SamplingFields.__struct_fields__) & _FIELDS) - {"stop", "logit_bias", "structured_outputs"}
)
# the fields a model's default fills when the request leaves them out (vLLM's list)
_DEFAULTED = (
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
)
# vLLM's older structured-output fields -> StructuredOutputsParams' (many clients send them)
_GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


@dataclass(frozen=True)
class ServerDefaults:
    """The model's sampling defaults as the server applies them, vLLM's way: a field the
    request leaves out takes the model's value; `max_tokens` is used when the request sets
    none, and `max_tokens_cap` caps even a request's own."""

    fields: dict[str, Any]
    max_tokens: int | None = None
    max_tokens_cap: int | None = None

    @classmethod
    def of(cls, model: ModelConfig) -> ServerDefaults:
        defaults = model.default_sampling_params
        cap = generation_defaults.max_tokens_cap(
            model.generation_config, defaults, model.override_generation_config
        )
        fields = {k: v for k, v in defaults.items() if k in _DEFAULTED}
        # a model's default is a wish, not a request's demand: what the context holds bounds it
        most = model.max_model_len
        default = defaults.get("max_tokens")
        return cls(
            fields,
            None if default is None else min(default, most),
            None if cap is None else min(cap, most),
        )

    def max_tokens_for(self, requested: int | None) -> int | None:
        value = requested if requested is not None else self.max_tokens
        if value is None or self.max_tokens_cap is None:
            return value if value is not None else self.max_tokens_cap
        return min(value, self.max_tokens_cap)


NO_DEFAULTS = ServerDefaults({})


def completion_sampling_params(
    request: CompletionRequest, stream: bool, defaults: ServerDefaults = NO_DEFAULTS
) -> SamplingParams:
    """SamplingParams for /v1/completions; `logprobs` is the number of top tokens."""
    values = _common(request, defaults)
    values["logprobs"] = request.logprobs
    if request.echo and request.logprobs is not None:
        values["prompt_logprobs"] = request.logprobs  # echoed prompt tokens get theirs too
    values["max_tokens"] = defaults.max_tokens_for(request.max_tokens)
    return _build(values, stream)


def chat_sampling_params(
    request: ChatCompletionRequest, stream: bool, defaults: ServerDefaults = NO_DEFAULTS
) -> SamplingParams:
    """SamplingParams for /v1/chat/completions; `logprobs` is a switch, `top_logprobs` the
    number of alternatives."""
    values = _common(request, defaults)
    if request.top_logprobs is not None and not request.logprobs:
        raise OpenAIError(
            "top_logprobs: when using `top_logprobs`, `logprobs` must be set to true",
            param="top_logprobs",
        )
    if request.logprobs:
        values["logprobs"] = request.top_logprobs or 0
    max_tokens = request.max_completion_tokens
    max_tokens = max_tokens if max_tokens is not None else request.max_tokens
    values["max_tokens"] = defaults.max_tokens_for(max_tokens)
    return _build(values, stream)


def _common(request: SamplingFields, defaults: ServerDefaults) -> dict[str, Any]:
    values = {name: v for name in _PASSED if (v := getattr(request, name)) is not None}
    for name, value in defaults.fields.items():
        values.setdefault(name, value)
    if request.stop is not None:
        values["stop"] = [request.stop] if isinstance(request.stop, str) else request.stop
    if request.logit_bias:
        values["logit_bias"] = _logit_bias(request.logit_bias)
    structured = _structured_outputs(request)
    if structured is not None:
        values["structured_outputs"] = structured
    return values


def _structured_outputs(request: SamplingFields) -> StructuredOutputsParams | None:
    """vLLM's `structured_outputs` body field, with OpenAI's `response_format` (json_object,
    json_schema) in place of its constraint, as vLLM applies it; vLLM's older `guided_*`
    fields when neither is given."""
    fields = dict(request.structured_outputs or {})
    param = "structured_outputs"
    if not fields:
        guided = {old: v for old in _GUIDED if (v := getattr(request, old)) is not None}
        fields = {_GUIDED[old]: v for old, v in guided.items()}
        param = next(iter(guided), param)
    fmt = request.response_format
    if fmt is not None and fmt.type != "text":
        param = "response_format"
        if fmt.type == "json_object":
            fields["json_object"] = True
        elif fmt.json_schema is None:
            raise OpenAIError(
                "When response_format type is 'json_schema', the 'json_schema' field must be "
                "provided.",
                param=param,
            )
        else:
            fields["json"] = fmt.json_schema.schema
    if not fields:
        return None
    unknown = sorted(set(fields) - set(StructuredOutputsParams.__struct_fields__))
    if unknown:
        raise OpenAIError(f"structured_outputs: unsupported fields {unknown}", param=param)
    try:
        return StructuredOutputsParams(**fields)
    except ValueError as e:
        raise OpenAIError(str(e), param=param) from None


def _logit_bias(bias: dict[str, float]) -> dict[int, float]:
    out = {}
    for key, value in bias.items():
        try:
            token_id = int(key)
        except ValueError:
            raise OpenAIError(
                f"logit_bias: keys must be token ids, got {key!r}", param="logit_bias"
            ) from None
        out[token_id] = min(100.0, max(-100.0, value))  # OpenAI's range
    return out


def _build(values: dict[str, Any], stream: bool) -> SamplingParams:
    values["output_kind"] = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY
    try:
        return SamplingParams(**values)
    except ValueError as e:
        raise from_value_error(e, _FIELDS) from None
