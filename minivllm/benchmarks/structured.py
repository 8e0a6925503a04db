"""`bench throughput --structured-outputs`: the same workload plain and under a JSON schema of
eight fields, timed on one engine, and how far the outputs got into the schema.

The schema mixes what services ask for: strings with patterns, integers and a number with
ranges, an enum, a boolean, an array and a nested object (no minLength/maxLength: inside a
string bounded so, xgrammar 0.2.8 checks nearly every token of a 151,936-token vocabulary
per step, 2-13 ms per row against ~3 us elsewhere). Whitespace between tokens is free, as by
default, so random weights stay inside the object, every step constrained. Requests keep
`ignore_eos`, so both runs produce the same tokens: a request whose object is complete
samples EOS (the only token the grammar then allows) and goes on unconstrained, as vLLM's do.
"""

from __future__ import annotations

import json
from typing import Any

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,15}( [A-Z][a-z]{1,15})?$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "pattern": "^[a-z0-9.]{1,16}@[a-z]{1,12}\\.(com|org|net)$"},
        "role": {"enum": ["admin", "editor", "viewer", "guest"]},
        "active": {"type": "boolean"},
        "score": {"type": "number", "minimum": 0, "maximum": 100},
        "tags": {
            "type": "array",
            "items": {"type": "string", "pattern": "^[a-z]{1,12}$"},
            "maxItems": 4,
        },
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "pattern": "^[A-Z][a-z]{1,19}$"},
                "zip": {"type": "integer", "minimum": 10000, "maximum": 99999},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "email", "role", "active", "score", "tags", "address"],
    "additionalProperties": False,
}


def summarize(outputs: list[Any], eos_token_ids: list[int]) -> dict[str, Any]:
    """How many outputs completed the object (a JSON value first, then EOS), and at which
    token on average; the others were still inside it at max_tokens."""
    complete, at = 0, []
    for out in outputs:
        comp = out.outputs[0]
        end = next((i for i, t in enumerate(comp.token_ids) if t in eos_token_ids), None)
        if end is None:
            continue
        try:
            value, _ = json.JSONDecoder(strict=False).raw_decode(comp.text)
        except ValueError:
            continue
        if isinstance(value, dict) and set(value) == set(SCHEMA["required"]):
            complete += 1
            at.append(end + 1)
    summary = {"num_outputs": len(outputs), "num_complete": complete}
    if at:
        summary["mean_tokens_to_complete"] = sum(at) / len(at)
    done = f", after {summary['mean_tokens_to_complete']:.0f} tokens on average" if at else ""
    print(
        f"json-schema: {complete} of {len(outputs)} outputs completed the schema{done}; "
        "the rest were inside it at max_tokens"
    )
    return summary
