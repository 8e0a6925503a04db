"""Shared pieces of the benchmarks (`minivllm bench` and the benchmarks/ scripts): the model
directory and engine args."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import tempfile
from collections.abc import Iterator
from typing import Any

from minivllm.benchmarks.geometry import (
    DEFAULT_CPU_GEOMETRY,
    DEFAULT_GPU_GEOMETRY,
    GEOMETRIES,
    write_geometry,
)
from minivllm.config import EngineArgs
from minivllm.devices import resolve_device
from minivllm.frontend.arg_utils import add_engine_args, engine_args_from
from minivllm.frontend.llm import LLM
from minivllm.model_files import read_hf_config
from minivllm.process_utils import freeze_startup_heap


def add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--geometry",
        choices=sorted(GEOMETRIES),
        default=None,
        help="without --model: random weights of this shape (default: qwen3-0.6b on CUDA, "
        "qwen3-cpu-tiny on CPU)",
    )


# engine args whose default differs in a benchmark: (default, help)
_BENCH_DEFAULTS = {
    "skip_tokenizer_init": (True, "no tokenizer: prompts are token ids (vLLM's benchmarks too)"),
    "load_format": (None, "default: dummy (random weights) without --model, auto with it"),
    "max_model_len": (
        None,
        "default: the model's; without --model, the workload's longest request (4096 at least)",
    ),
}


def add_bench_args(parser: argparse.ArgumentParser, output_json: bool = True) -> None:
    """--geometry, EngineArgs' flags (--model optional; the defaults a benchmark uses) and
    --output-json."""
    add_model_args(parser)
    add_engine_args(parser, model_required=False)
    for action in parser._actions:
        if action.dest in _BENCH_DEFAULTS:
            action.default, action.help = _BENCH_DEFAULTS[action.dest]
    if output_json:
        parser.add_argument("--output-json", default=None, help="write the figures to this file")


@contextlib.contextmanager
def model_dir(args: argparse.Namespace) -> Iterator[tuple[str, str | None]]:
    """(directory, geometry name or None): --model as given, else a temp dir holding the
    config.json of a real geometry (weights are random: `load_format="dummy"`)."""
    if args.model:
        yield args.model, None
        return
    geometry = args.geometry or (
        DEFAULT_GPU_GEOMETRY if resolve_device(args.device) == "cuda" else DEFAULT_CPU_GEOMETRY
    )
    with tempfile.TemporaryDirectory(prefix=f"minivllm-{geometry}-") as d:
        yield write_geometry(geometry, d), geometry


def bench_engine_args(
    args: argparse.Namespace, model: str, geometry: str | None, **overrides: Any
) -> EngineArgs:
    """EngineArgs from the command line (`add_bench_args`' defaults): a geometry gets dummy
    weights unless --load-format says otherwise."""
    values: dict[str, Any] = {"model": model}
    if args.load_format is None:
        values["load_format"] = "auto" if geometry is None else "dummy"
    values.update(overrides)
    return engine_args_from(args, **values)


def start_llm(
    args: argparse.Namespace, model: str, geometry: str | None, max_len: int, **overrides: Any
) -> LLM:
    """The `LLM` of a bench command (`bench_engine_args`); a geometry's context fits
    `max_len` tokens (4096 at least) unless --max-model-len says otherwise."""
    if geometry is not None and args.max_model_len is None:
        overrides["max_model_len"] = max(4096, max_len)
    llm = LLM(**dataclasses.asdict(bench_engine_args(args, model, geometry, **overrides)))
    freeze_startup_heap()  # the bench command's own process
    return llm


def max_token_id(model: str) -> int:
    """The largest id a random prompt may use: 10000 (vLLM's and the reference workload's
    range) unless the model's vocabulary is smaller."""
    return min(10000, int(read_hf_config(model)["vocab_size"]) - 1)


def token_prompts(prompts: list[list[int]]) -> list[dict[str, list[int]]]:
    return [{"prompt_token_ids": p} for p in prompts]


def spec_decode_figures(llm: LLM) -> dict[str, Any]:
    """With speculative decoding, the engine's counters since it started (warm-up runs
    included), printed as vLLM's stats line words them; else {}."""
    if llm.llm_engine.config.speculative is None:
        return {}
    stats = llm.llm_engine.get_stats()
    drafts, drafted = stats["spec_num_drafts"], stats["spec_num_draft_tokens"]
    accepted = stats["spec_num_accepted_tokens"]
    per_pos = stats["spec_num_accepted_tokens_per_pos"]
    rate = 100 * accepted / drafted if drafted else float("nan")
    mean_len = 1 + accepted / drafts if drafts else float("nan")
    rates = ", ".join(f"{n / drafts:.3f}" for n in per_pos) if drafts else "-"
    print(
        f"SpecDecoding: Mean acceptance length: {mean_len:.2f}, Accepted: {accepted} tokens, "
        f"Drafted: {drafted} tokens, Per-position acceptance rate: {rates}, "
        f"Avg Draft acceptance rate: {rate:.1f}% (over {drafts} drafts)"
    )
    return {
        "spec_num_drafts": drafts,
        "spec_num_draft_tokens": drafted,
        "spec_num_accepted_tokens": accepted,
        "spec_num_accepted_tokens_per_pos": per_pos,
        "spec_acceptance_rate": rate,
        "spec_mean_acceptance_length": mean_len,
    }
