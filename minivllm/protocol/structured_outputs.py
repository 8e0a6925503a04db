"""Structured outputs: what a request's text must be (vLLM's `StructuredOutputsParams`).

Exactly one constraint: a JSON schema (`json`, a dict or its JSON text), any JSON object
(`json_object=True`), a regular expression (`regex`), one of a list of strings (`choice`) or
a grammar (`grammar`: EBNF as xgrammar reads it, or Lark syntax). The fields are checked on
construction, so a bad one raises `ValueError` naming it in the caller's process; whether
the grammar itself parses is checked by the frontend before the request leaves
(`minivllm.engine_core.structured_output.grammar.check`).

On the wire a schema travels as its JSON text (the frontend turns a dict into it), so the
engine-core's grammar cache is keyed by plain strings.
"""

from __future__ import annotations

import enum
import json as json_lib
from typing import Any, NamedTuple

import msgspec

from minivllm.protocol.limits import (
    MAX_CHOICE_CHARS,
    MAX_CHOICES,
    MAX_GRAMMAR_CHARS,
    Choices,
    GrammarText,
)

MAX_JSON_NESTING = 64  # vLLM's limit on objects and arrays nested in a schema
_TOO_DEEP = (
    "structured_outputs.json: the JSON schema is nested too deeply: objects and arrays "
    f"may nest at most {MAX_JSON_NESTING} levels"
)
CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")  # exactly one is set


class GrammarKind(enum.IntEnum):
    """How `GrammarSpec.text` is to be compiled."""

    JSON = 0  # a JSON schema
    REGEX = 1
    EBNF = 2  # also a `choice`, written as a grammar
    LARK = 3


class GrammarSpec(NamedTuple):
    """A constraint reduced to what compiles it: the engine-core's grammar cache key."""

    kind: GrammarKind
    text: str
    any_whitespace: bool = True  # JSON only: whitespace between tokens as the model likes


class StructuredOutputsParams(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One structured-output constraint for a request (`SamplingParams.structured_outputs`)."""

    json: GrammarText | dict[str, Any] | None = None  # a JSON schema
    regex: GrammarText | None = None
    choice: Choices | None = None
    grammar: GrammarText | None = None  # EBNF (`root ::= ...`), or Lark when it has no `::=`
    json_object: bool | None = None  # any JSON object
    # JSON: no whitespace between tokens but what the separators ", " and ": " hold
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [name for name in CONSTRAINTS if getattr(self, name) is not None]
        if len(given) != 1:
            which = f"but {', '.join(given)} are specified" if given else "but none is specified"
            raise ValueError(
                "structured_outputs: exactly one of json, regex, choice, grammar or "
                f"json_object must be set, {which}"
            )
        if self.json is not None:
            _check_json(self.json)
        if self.regex is not None:
            if not isinstance(self.regex, str):
                raise ValueError(f"structured_outputs.regex must be a str, got {self.regex!r:.80}")
            if "\x00" in self.regex:
                raise ValueError(
                    "structured_outputs.regex must not contain a NUL character ('\\x00')"
                )
        if self.choice is not None and (
            not isinstance(self.choice, list)
            or not self.choice
            or not all(isinstance(c, str) for c in self.choice)
        ):
            raise ValueError(
                f"structured_outputs.choice must be a non-empty list of strings, got {self.choice!r:.80}"
            )
        if self.grammar is not None and (
            not isinstance(self.grammar, str) or not self.grammar.strip()
        ):
            raise ValueError("structured_outputs.grammar cannot be an empty string")
        if self.json_object is not None and self.json_object is not True:
            raise ValueError(
                "structured_outputs.json_object must be True if set; omit "
                "structured_outputs to disable structured outputs"
            )
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError(
                "structured_outputs.disable_any_whitespace must be a bool, got "
                f"{self.disable_any_whitespace!r}"
            )
        self._check_sizes()

    def _check_sizes(self) -> None:
        """The bounds a receiver enforces on decode (limits.py), as errors for the user."""
        schema = self.json
        if isinstance(schema, dict):
            schema = json_lib.dumps(schema)
        for name, text in (("json", schema), ("regex", self.regex), ("grammar", self.grammar)):
            if text is not None and len(text) > MAX_GRAMMAR_CHARS:
                raise ValueError(
                    f"structured_outputs.{name}: at most {MAX_GRAMMAR_CHARS} characters, "
                    f"got {len(text)}"
                )
        if self.choice is not None and (
            len(self.choice) > MAX_CHOICES or max(map(len, self.choice)) > MAX_CHOICE_CHARS
        ):
            raise ValueError(
                f"structured_outputs.choice: at most {MAX_CHOICES} strings of at most "
                f"{MAX_CHOICE_CHARS} characters each"
            )

    def spec(self) -> GrammarSpec:
        """The grammar this constraint compiles to."""
        any_ws = not self.disable_any_whitespace
        if self.json is not None:
            text = self.json if isinstance(self.json, str) else json_lib.dumps(self.json)
            return GrammarSpec(GrammarKind.JSON, text, any_ws)
        if self.json_object:
            return GrammarSpec(GrammarKind.JSON, '{"type": "object"}', any_ws)
        if self.regex is not None:
            return GrammarSpec(GrammarKind.REGEX, self.regex)
        if self.choice is not None:
            return GrammarSpec(GrammarKind.EBNF, choice_grammar(self.choice))
        if "::=" in _without_comments(self.grammar):
            return GrammarSpec(GrammarKind.EBNF, self.grammar)
        return GrammarSpec(GrammarKind.LARK, self.grammar)


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose only sentences are `choices`."""
    escapes = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t"}

    def literal(s: str) -> str:
        out = (
            escapes.get(c) or (f"\\u{ord(c):04x}" if ord(c) < 0x20 or ord(c) == 0x7F else c)
            for c in s
        )
        return '"' + "".join(out) + '"'

    return "root ::= " + " | ".join(literal(c) for c in choices)


def _check_json(schema: Any) -> None:
    if isinstance(schema, str):
        if not schema.strip():
            raise ValueError("structured_outputs.json cannot be an empty string")
        try:
            schema = json_lib.loads(schema)
        except RecursionError:  # nested past Python's own limit
            raise ValueError(_TOO_DEEP) from None
        except ValueError as e:
            raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
    if not isinstance(schema, dict):
        raise ValueError(
            f"structured_outputs.json must be a JSON schema (an object), got {schema!r:.80}"
        )
    level = [schema]
    for _ in range(MAX_JSON_NESTING):
        level = [
            child
            for node in level
            for child in (node.values() if isinstance(node, dict) else node)
            if isinstance(child, (dict, list))
        ]
        if not level:
            return
    raise ValueError(_TOO_DEEP)


def _without_comments(grammar: str) -> str:
    return "\n".join(line.split("#")[0].split("//")[0] for line in grammar.splitlines())
