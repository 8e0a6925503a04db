"""Request and response bodies of the OpenAI API (and vLLM's extra request fields).

Requests decode with msgspec: a field of the wrong type is a 400 naming the field; unknown
fields are ignored, as vLLM does, with a warning naming each once (`app.py`). Responses
encode with msgspec; fields OpenAI always sends are sent even when null.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec


class StreamOptions(msgspec.Struct):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage in every chunk


class JsonSchemaFormat(msgspec.Struct, kw_only=True):
    """OpenAI's `response_format.json_schema`."""

    name: str
    description: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, kw_only=True):
    """OpenAI's `response_format`: free text, any JSON object, or JSON of a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class SamplingFields(msgspec.Struct, kw_only=True):
    """The fields completions and chat share: OpenAI's, then vLLM's extras."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None
    return_token_ids: bool = False
    stream_interval: int | None = None  # new tokens per streamed chunk (SamplingParams')
    response_format: ResponseFormat | None = None
    # vLLM's StructuredOutputsParams fields (json, regex, choice, grammar, json_object, ...)
    structured_outputs: dict[str, Any] | None = None
    # vLLM's older spellings of structured_outputs' json, regex, choice and grammar
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class CompletionRequest(SamplingFields, kw_only=True):
    prompt: Any = None  # str, [str], [int] or [[int]]: checked by completions.py
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True


class ChatCompletionRequest(SamplingFields, kw_only=True):
    messages: list[dict[str, Any]]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = False


class TokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    tokens: list[int]


# ---------------------------------------------------------------- responses


class UsageInfo(msgspec.Struct):
    prompt_tokens: int = 0
    total_tokens: int = 0
    completion_tokens: int = 0


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: list[dict[str, Any] | None] | None = None


class CompletionResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None
    object: str = "text_completion"


class ChatMessage(msgspec.Struct):
    content: str
    role: str = "assistant"


class ChatChoice(msgspec.Struct):
    index: int
    message: ChatMessage
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    object: str = "chat.completion"
    prompt_token_ids: list[int] | None = None


class DeltaMessage(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None


class ChatStreamChoice(ChatChoice, rename={"message": "delta"}):
    """A whole choice's fields, its message a delta (sent as `delta`)."""

    message: DeltaMessage


class StreamResponse(msgspec.Struct, omit_defaults=True):
    """One SSE chunk of either endpoint (`object` says which); `usage` only when asked."""

    id: str
    object: str
    created: int
    model: str
    choices: list[Any]
    usage: UsageInfo | None = None


class ModelPermission(msgspec.Struct):
    id: str
    created: int
    object: str = "model_permission"
    allow_create_engine: bool = False
    allow_sampling: bool = True
    allow_logprobs: bool = True
    allow_search_indices: bool = False
    allow_view: bool = True
    allow_fine_tuning: bool = False
    organization: str = "*"
    group: str | None = None
    is_blocking: bool = False


class ModelCard(msgspec.Struct):
    id: str
    created: int
    root: str
    max_model_len: int
    permission: list[ModelPermission]
    object: str = "model"
    owned_by: str = "minivllm"
    parent: str | None = None


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: str = "list"
