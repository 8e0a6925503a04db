"""Request fields -> `SamplingParams`, with vLLM's names. A field reaches SamplingParams
only when the client sent it, so SamplingParams' defaults stay the defaults."""

from __future__ import annotations

from typing import Any

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


def completion_sampling_params(request: CompletionRequest, stream: bool) -> SamplingParams:
    """SamplingParams for /v1/completions; `logprobs` is the number of top tokens."""
    values = _common(request)
    values["logprobs"] = request.logprobs
    if request.echo and request.logprobs is not None:
        values["prompt_logprobs"] = request.logprobs  # echoed prompt tokens get theirs too
    values["max_tokens"] = request.max_tokens
    return _build(values, stream)


def chat_sampling_params(request: ChatCompletionRequest, stream: bool) -> SamplingParams:
    """SamplingParams for /v1/chat/completions; `logprobs` is a switch, `top_logprobs` the
    number of alternatives."""
    values = _common(request)
    if request.top_logprobs is not None and not request.logprobs:
        raise OpenAIError(
            "top_logprobs: when using `top_logprobs`, `logprobs` must be set to true",
            param="top_logprobs",
        )
    if request.logprobs:
        values["logprobs"] = request.top_logprobs or 0
    max_tokens = request.max_completion_tokens
    values["max_tokens"] = max_tokens if max_tokens is not None else request.max_tokens
    return _build(values, stream)


def _common(request: SamplingFields) -> dict[str, Any]:
    values = {name: v for name in _PASSED if (v := getattr(request, name)) is not None}
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
    json_schema) in place of its constraint, as vLLM applies it."""
    fields = dict(request.structured_outputs or {})
    param = "structured_outputs"
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
