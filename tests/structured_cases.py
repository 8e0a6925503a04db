"""Constraints for the structured-output tests and how to check what a random model wrote
under them. On a tiny random checkpoint nothing but the grammar mask makes text valid."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema

from minivllm import SamplingParams, StructuredOutputsParams

# objects, arrays, enums, integers (with ranges), a nested object, strings with patterns
SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
        "role": {"enum": ["admin", "user", "guest"]},
        "active": {"type": "boolean"},
        "scores": {
            "type": "array",
            "items": {"type": "integer", "minimum": -50, "maximum": 50},
            "minItems": 1,
            "maxItems": 3,
        },
        "owner": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "pattern": "^[A-Z][a-z]{0,4}$"},
                "level": {"enum": [1, 2, 3]},
            },
            "required": ["name", "level"],
            "additionalProperties": False,
        },
    },
    "required": ["id", "name", "role", "active", "scores", "owner"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,6}@[a-z]{2,5}\.(com|org|net)"
CHOICES = ["yes", "no", "maybe so", 'say "hi"']
# balanced brackets around one letter: context-free, not regular
EBNF = 'root ::= nest\nnest ::= "(" nest ")" | "[" nest "]" | [a-e]'


def constraints() -> dict[str, StructuredOutputsParams]:
    """One of each kind; JSON without free whitespace, which a random model would fill.
    (`json_object` allows free strings, which a random model seldom closes: see
    `json_object_params`.)"""
    return {
        "json": StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
        "regex": StructuredOutputsParams(regex=REGEX),
        "choice": StructuredOutputsParams(choice=CHOICES),
        "ebnf": StructuredOutputsParams(grammar=EBNF),
    }


def json_object_params(tokenizer: Any, **kwargs: Any) -> SamplingParams:
    """Any JSON object, with the closing quote and brace favoured by a logit bias (applied
    after the grammar's mask, so it can only choose among what the grammar allows)."""
    favoured = tokenizer.convert_tokens_to_ids(['"', "}"])
    return SamplingParams(
        temperature=1.0,
        max_tokens=120,
        logit_bias={t: 6.0 for t in favoured},
        structured_outputs=StructuredOutputsParams(json_object=True, disable_any_whitespace=True),
        **kwargs,
    )


def check_text(kind: str, text: str) -> None:
    """Assert `text` is a complete sentence of the constraint `kind` of `constraints()`."""
    if kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict), text
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "choice":
        assert text in CHOICES, text
    else:
        assert derives_nest(text), text


def derives_nest(text: str) -> bool:
    """Whether `text` derives from EBNF's `nest`: brackets that pair up around a letter."""
    closing = {"(": ")", "[": "]"}
    depth = 0
    while depth < len(text) and text[depth] in closing:
        depth += 1
    if len(text) != 2 * depth + 1 or text[depth] not in "abcde":
        return False
    return all(closing[text[i]] == text[-1 - i] for i in range(depth))


def grammar_accepts(model_dir: str, vocab_size: int, so: StructuredOutputsParams, ids: list[int]):
    """Whether a fresh xgrammar matcher for `so` takes every token of `ids` (a valid prefix,
    for outputs that max_tokens cut inside the structure)."""
    from minivllm.engine_core.structured_output.grammar import GrammarCompiler

    compiler = GrammarCompiler(model_dir, vocab_size)
    matcher = compiler.matcher(compiler.compile(so.spec()), None)
    return all(matcher.accept_token(t) for t in ids)
