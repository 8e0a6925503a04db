"""StructuredOutputsParams: vLLM's fields and messages, checked where the caller builds them;
the grammar each compiles to; its bitmask on the wire as one raw frame."""

from __future__ import annotations

import json

import numpy as np
import pytest

from minivllm import SamplingParams, StructuredOutputsParams
from minivllm.protocol.messages import EngineCoreRequest, GrammarBitmask
from minivllm.protocol.serial import (
    CORE_TO_WORKER,
    FRONTEND_TO_CORE,
    MsgDecoder,
    MsgEncoder,
    ProtocolError,
)
from minivllm.protocol.structured_outputs import GrammarKind, choice_grammar

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def _deep(levels: int) -> dict:
    node: dict = {}
    root = {"deep": node}
    for _ in range(levels):
        node["x"] = {}
        node = node["x"]
    return root


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "exactly one of json, regex, choice, grammar or json_object must be set"),
        ({"json": SCHEMA, "regex": "a"}, "but json, regex are specified"),
        ({"json": ""}, "structured_outputs.json cannot be an empty string"),
        ({"json": "{not json"}, "structured_outputs.json is not valid JSON"),
        ({"json": "[1, 2]"}, "structured_outputs.json must be a JSON schema"),
        ({"json": "[" * 70 + "]" * 70}, "structured_outputs.json must be a JSON schema"),
        ({"json": _deep(70)}, "nested too deeply"),
        ({"regex": "a\x00"}, "structured_outputs.regex must not contain a NUL"),
        ({"choice": []}, "structured_outputs.choice must be a non-empty list of strings"),
        ({"choice": ["a", 1]}, "structured_outputs.choice must be a non-empty list of strings"),
        ({"grammar": "  "}, "structured_outputs.grammar cannot be an empty string"),
        ({"json_object": False}, "structured_outputs.json_object must be True if set"),
    ],
)
def test_bad_fields_raise_naming_the_field(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        StructuredOutputsParams(**kwargs)


def test_sampling_params_takes_only_structured_outputs_params() -> None:
    with pytest.raises(ValueError, match="structured_outputs must be StructuredOutputsParams"):
        SamplingParams(structured_outputs={"json": SCHEMA})


def test_each_constraint_compiles_to_its_grammar() -> None:
    spec = StructuredOutputsParams(json=SCHEMA).spec()
    assert spec.kind == GrammarKind.JSON and json.loads(spec.text) == SCHEMA and spec.any_whitespace
    compact = StructuredOutputsParams(json=json.dumps(SCHEMA), disable_any_whitespace=True).spec()
    assert not compact.any_whitespace
    assert StructuredOutputsParams(json_object=True).spec().text == '{"type": "object"}'
    assert StructuredOutputsParams(regex="[a-z]+").spec() == (GrammarKind.REGEX, "[a-z]+", True)
    assert StructuredOutputsParams(grammar='root ::= "x"').spec().kind == GrammarKind.EBNF
    assert StructuredOutputsParams(grammar='start: "x"').spec().kind == GrammarKind.LARK
    assert StructuredOutputsParams(choice=["a", "b"]).spec().kind == GrammarKind.EBNF
    # quotes, backslashes and control characters are escaped, so each choice is one literal
    assert choice_grammar(['say "hi"', "a\\b", "x\ny\x01"]) == (
        r'root ::= "say \"hi\"" | "a\\b" | "x\ny\u0001"'
    )


def test_params_travel_and_are_checked_again_on_arrival() -> None:
    params = SamplingParams(structured_outputs=StructuredOutputsParams(regex="[0-9]+"))
    frames = MsgEncoder().encode(EngineCoreRequest("r", [1], params))
    got = MsgDecoder(FRONTEND_TO_CORE).decode(frames)
    assert got.sampling_params.structured_outputs.regex == "[0-9]+"
    # a peer that sends two constraints gets a protocol error, not a request
    params.structured_outputs.choice = ["b"]  # past the constructor's check
    with pytest.raises(ProtocolError, match="exactly one"):
        MsgDecoder(FRONTEND_TO_CORE).decode(
            MsgEncoder().encode(EngineCoreRequest("r", [1], params))
        )


def test_bitmask_travels_as_one_raw_frame() -> None:
    """256 rows of Qwen3's vocabulary: the body stays small, the rows are one buffer."""
    bitmask = np.random.default_rng(0).integers(-(2**31), 2**31, (256, 4748), dtype=np.int32)
    frames = MsgEncoder().encode(GrammarBitmask(7, bitmask))
    assert len(frames[0]) < 100
    assert max(memoryview(f).nbytes for f in frames) == bitmask.nbytes
    got = MsgDecoder(CORE_TO_WORKER).decode(frames)
    assert got.step_id == 7 and np.array_equal(got.bitmask, bitmask)
