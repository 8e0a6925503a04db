"""Grammars through xgrammar: check that a constraint parses (in the frontend, before the
request leaves), and compile it against the tokenizer's vocabulary (in the engine-core, on a
compile thread). xgrammar is an optional install (`pip install 'minivllm[structured]'`)."""

from __future__ import annotations

import functools
import os
import re
from typing import Any

from minivllm.gguf_file import pretrained_args
from minivllm.hf_imports import from_transformers, import_locked
from minivllm.protocol.structured_outputs import (
    CONSTRAINTS,
    GrammarKind,
    GrammarSpec,
    StructuredOutputsParams,
)

_NATIVE_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # xgrammar's "[time] file.cc:line: "
# JSON formats the xgrammar converter enforces; others it would let through unchecked
_STRING_FORMATS = frozenset({"email", "date", "time", "date-time", "duration", "hostname", "uuid"})
_STRING_FORMATS |= {"ipv4", "ipv6", "uri", "uri-reference", "uri-template", "json-pointer"}
_STRING_FORMATS |= {"relative-json-pointer"}


def xgrammar() -> Any:
    """The xgrammar module, or a `ValueError` that says how to install it."""
    try:
        xgr = import_locked("xgrammar")
    except ImportError:
        raise ValueError(
            "structured_outputs need the xgrammar package: pip install 'minivllm[structured]'"
        ) from None
    return xgr


def check(params: StructuredOutputsParams) -> None:
    """Raise `ValueError` naming the field if the constraint does not parse into a grammar
    (no vocabulary needed: the compile against it happens in the engine-core)."""
    xgrammar()
    field = next(name for name in CONSTRAINTS if getattr(params, name) is not None)
    error = _check_spec(params.spec())
    if error:
        raise ValueError(f"structured_outputs.{field}: {error}")


@functools.lru_cache(maxsize=256)
def _check_spec(spec: GrammarSpec) -> str | None:
    """Why `spec` does not parse, or None; cached, as requests often share a constraint."""
    if spec.kind == GrammarKind.JSON:
        unsupported = unsupported_json_feature(spec.text)
        if unsupported:
            return f"the schema uses {unsupported}, which xgrammar cannot enforce"
    try:
        parse(spec)
    except Exception as e:
        return describe_error(e)
    return None


def parse(spec: GrammarSpec) -> Any:
    """`spec` as an xgrammar `Grammar`; raises xgrammar's error when it does not parse."""
    grammar = xgrammar().Grammar
    if spec.kind == GrammarKind.JSON:
        # disable_any_whitespace: compact JSON, as vLLM asks of xgrammar
        separators = None if spec.any_whitespace else (",", ":")
        return grammar.from_json_schema(
            spec.text, any_whitespace=spec.any_whitespace, separators=separators
        )
    if spec.kind == GrammarKind.REGEX:
        return grammar.from_regex(spec.text)
    if spec.kind == GrammarKind.EBNF:
        return grammar.from_ebnf(spec.text)
    return grammar.from_lark(spec.text)


def describe_error(e: BaseException) -> str:
    """xgrammar's message without its source location."""
    return _NATIVE_PREFIX.sub("", str(e).strip()) or type(e).__name__


class GrammarCompiler:
    """xgrammar's compiler over one tokenizer's vocabulary, padded to the model's."""

    def __init__(self, tokenizer: str, vocab_size: int) -> None:
        AutoTokenizer = from_transformers("", "AutoTokenizer")
        xgr = xgrammar()
        name, kwargs = pretrained_args(tokenizer)
        tok = AutoTokenizer.from_pretrained(name, **kwargs)
        info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab_size)
        # a quarter of the cores per compile: the busy loop, the workers' host threads and
        # the bitmask fills keep theirs
        threads = max(1, min(8, (os.cpu_count() or 1) // 4))
        self._compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False)

    def compile(self, spec: GrammarSpec) -> Any:
        """The compiled grammar of `spec` (an xgrammar `CompiledGrammar`); raises ValueError
        with xgrammar's reason when it does not compile."""
        try:
            return self._compiler.compile_grammar(parse(spec))
        except Exception as e:
            raise ValueError(f"the grammar does not compile: {describe_error(e)}") from None

    def matcher(self, compiled: Any, stop_token_ids: list[int] | None) -> Any:
        """A fresh matcher at the start of `compiled`; `stop_token_ids` end the grammar (the
        tokenizer's EOS when None). It can step back over any number of tokens (the draft
        tokens of speculative decoding)."""
        return xgrammar().GrammarMatcher(compiled, override_stop_tokens=stop_token_ids or None)


def unsupported_json_feature(schema: Any) -> str | None:
    """The first keyword combination in `schema` that xgrammar would silently not enforce
    (so its output would not validate), as vLLM refuses them; None if there is none."""
    import json

    if isinstance(schema, str):
        schema = json.loads(schema)
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        kind = node.get("type")
        types = {kind} if isinstance(kind, str) else set(kind) if isinstance(kind, list) else set()
        if types & {"integer", "number"} and "multipleOf" in node:
            return "multipleOf"
        if "array" in types:
            for key in ("uniqueItems", "contains", "minContains", "maxContains"):
                if key in node:
                    return key
        if "string" in types:
            if "format" in node and node["format"] not in _STRING_FORMATS:
                return f"the string format {node['format']!r}"
            if ("pattern" in node or "format" in node) and (
                "minLength" in node or "maxLength" in node
            ):
                return "a pattern or format with minLength/maxLength"
        if "object" in types and (
            ("propertyNames" in node and ("properties" in node or "patternProperties" in node))
            or ("patternProperties" in node and "properties" in node)
        ):
            return "propertyNames or patternProperties beside properties"
        if isinstance(node.get("allOf"), list) and len(node["allOf"]) >= 2:
            return "allOf with several branches"
        stack.extend(node.values())
    return None
