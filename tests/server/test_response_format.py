"""Structured outputs through the OpenAI API: `response_format` (json_schema, json_object)
and vLLM's `structured_outputs` body field reach the engine's grammars; bad ones are 400s."""

from __future__ import annotations

import json

import openai
import pytest
from transformers import AutoTokenizer

from tests.server.conftest import MODEL
from tests.structured_cases import CHOICES, REGEX, SCHEMA, check_text

CHAT = [{"role": "user", "content": "Describe a user"}]
COMPACT = {"structured_outputs": {"disable_any_whitespace": True}}


@pytest.fixture(scope="module")
def client(api_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{api_server.url}/v1", api_key="unused", max_retries=0)


def json_schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "user", "schema": schema}}


def test_chat_response_format_json_schema(client: openai.OpenAI) -> None:
    kwargs = dict(model=MODEL, messages=CHAT, temperature=1.0, max_tokens=120, extra_body=COMPACT)
    for seed in range(3):
        out = client.chat.completions.create(
            **kwargs, seed=seed, response_format=json_schema_format(SCHEMA)
        )
        assert out.choices[0].finish_reason == "stop"
        check_text("json", out.choices[0].message.content)
    chunks = client.chat.completions.create(
        **kwargs, seed=7, stream=True, response_format=json_schema_format(SCHEMA)
    )
    check_text("json", "".join(c.choices[0].delta.content or "" for c in chunks if c.choices))


def test_completions_structured_outputs_field(client: openai.OpenAI) -> None:
    for kind, fields in (("choice", {"choice": CHOICES}), ("regex", {"regex": REGEX})):
        out = client.completions.create(
            model=MODEL,
            prompt="Answer:",
            temperature=1.0,
            seed=1,
            max_tokens=40,
            n=2,
            extra_body={"structured_outputs": fields},
        )
        for choice in out.choices:
            check_text(kind, choice.text)


def test_response_format_json_object(client: openai.OpenAI, qwen3_dir: str) -> None:
    tok = AutoTokenizer.from_pretrained(qwen3_dir)
    # the closing quote and brace favoured, so a random model closes its strings
    bias = {str(t): 6 for t in tok.convert_tokens_to_ids(['"', "}"])}
    out = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        temperature=1.0,
        seed=2,
        max_tokens=120,
        logit_bias=bias,
        response_format={"type": "json_object"},
        extra_body=COMPACT,
    )
    assert isinstance(json.loads(out.choices[0].message.content), dict)


@pytest.mark.parametrize(
    ("extra", "param", "message"),
    [
        ({"response_format": {"type": "json_schema"}}, "response_format", "'json_schema' field"),
        (
            {"response_format": json_schema_format({"type": "object", "x-bad": {"type": 3}})}
            | {"extra_body": {"structured_outputs": {"regex": "a"}}},
            "response_format",
            "exactly one of json, regex",
        ),
        (
            {"extra_body": {"structured_outputs": {"json": {"type": "nope"}}}},
            "structured_outputs",
            "structured_outputs.json: ",
        ),
        (
            {"extra_body": {"structured_outputs": {"structural_tag": "{}"}}},
            "structured_outputs",
            "unsupported fields ['structural_tag']",
        ),
    ],
)
def test_bad_constraints_are_400s(client: openai.OpenAI, extra, param, message) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5, **extra)
    error = info.value.body
    assert error["param"] == param and message in error["message"]
