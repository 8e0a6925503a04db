"""`minivllm bench ...`: benchmarks whose output reads like vLLM's. Each command is a module
of this package: its docstring is the command's description, `add_arguments(parser)` (if
any) adds its flags and `main(args)` runs it and returns its figures, which --output-json
(where a command has it) writes as JSON."""

from __future__ import annotations

import argparse
import functools
import importlib
import json
from collections.abc import Callable
from typing import Any

COMMANDS = {  # name (its module: the name with "_" for "-"): help
    "throughput": "offline throughput (vLLM's `bench throughput`)",
    "latency": "batch latency, TTFT and TPOT (vLLM's `bench latency`)",
    "serve": "load an OpenAI-compatible server (vLLM's `bench serve`)",
    "overhead": "engine overhead with the null model (tok/s, µs per step, IPC round trip)",
    "kv-accuracy": "next-token agreement and KL of an FP8 KV cache against the model's dtype",
    "step": "host and GPU time of one decode or prefill step of the model runner",
    "kernels": "check and time the Triton kernels (attention bf16/FP8/cascade, sampler, ops)",
    "trace": "summarize a MINIVLLM_STEP_TRACE file: time per step kind and batch size",
    "grammar": "structured outputs: the core's per-step grammar work; steps while grammars compile",
    "tp-equality": "greedy tokens at several tensor-parallel sizes, compared token for token",
    "allreduce": "2-GPU all-reduce: NCCL against the Triton one-shot kernel, "
    "and fused with RMSNorm",
}


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    from minivllm.frontend.arg_utils import HelpFormatter

    p = sub.add_parser("bench", help="throughput, latency, serving and engine-overhead benchmarks")
    bench_sub = p.add_subparsers(dest="bench_command", required=True)
    for name, help in COMMANDS.items():
        module = importlib.import_module(f"minivllm.benchmarks.{name.replace('-', '_')}")
        cmd = bench_sub.add_parser(
            name,
            help=help,
            description=module.__doc__,
            formatter_class=HelpFormatter,
        )
        if hasattr(module, "add_arguments"):
            module.add_arguments(cmd)
        cmd.set_defaults(func=functools.partial(_run, module.main))


def _run(main: Callable[[argparse.Namespace], Any], args: argparse.Namespace) -> None:
    figures = main(args)
    if getattr(args, "output_json", None):
        with open(args.output_json, "w") as f:
            json.dump(figures, f, indent=2)
