"""EngineArgs on the command line: one `--flag` per field, with vLLM's spelling."""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing

from minivllm.config import EngineArgs

_SKIP = {"hf_overrides"}


def add_engine_args(parser: argparse.ArgumentParser, model_required: bool = True) -> None:
    hints = typing.get_type_hints(EngineArgs)
    for f in dataclasses.fields(EngineArgs):
        if f.name in _SKIP:
            continue
        flag = "--" + f.name.replace("_", "-")
        kind = hints[f.name]
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
            continue
        base = _base_type(kind)
        required = f.name == "model" and model_required
        default = None if f.name == "model" else f.default
        parser.add_argument(flag, type=base, default=default, required=required)


def _base_type(kind: typing.Any) -> type:
    if isinstance(kind, types.UnionType) or typing.get_origin(kind) is typing.Union:
        args = [a for a in typing.get_args(kind) if a is not type(None)]
        return args[0]
    return kind


def engine_args_from(ns: argparse.Namespace, **overrides: typing.Any) -> EngineArgs:
    values = {
        f.name: getattr(ns, f.name)
        for f in dataclasses.fields(EngineArgs)
        if f.name not in _SKIP and hasattr(ns, f.name)
    }
    values.update(overrides)
    return EngineArgs(**values)
