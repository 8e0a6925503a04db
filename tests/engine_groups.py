"""Drive an in-process `EngineCore` with prompts that arrive in groups."""

from __future__ import annotations

from typing import Any


def run_groups(core: Any, groups: list[list[list[int]]], params: Any) -> list[list[int]]:
    """Add each group of prompts once the previous ones have finished (so its first step
    carries only its prompts) and step until it is done; every prompt's tokens, in order."""
    from minivllm.protocol.messages import EngineCoreRequest

    got: dict[str, list[int]] = {}
    for g, group in enumerate(groups):
        for i, p in enumerate(group):
            core.add_request(EngineCoreRequest(f"{g}.{i}", p, params))
        while core.has_work():
            for outs in core.step().values():
                for o in outs.outputs:
                    got.setdefault(o.request_id, []).extend(o.new_token_ids)
    return [got[f"{g}.{i}"] for g, group in enumerate(groups) for i in range(len(group))]
