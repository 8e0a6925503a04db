"""`minivllm bench throughput|latency|serve`: vLLM's three benchmarks, printed the way vLLM
prints them. Each command is a module of this package: its docstring is the command's
description, `add_arguments(parser)` adds its flags and `main(args)` runs it and returns its
figures, which --output-json writes as JSON.

The other tools (kernels, one step, KV accuracy, traces, ...) are scripts in the repository's
benchmarks/ directory, built the same way and run by `run_script`; they use this package's
geometries, workloads and engine arguments."""

from __future__ import annotations

import argparse
import functools
import importlib
import json
from collections.abc import Callable, Sequence
from typing import Any

COMMANDS = {  # name (its module): help
    "throughput": "offline throughput (vLLM's `bench throughput`)",
    "latency": "batch latency, TTFT and TPOT (vLLM's `bench latency`)",
    "serve": "load an OpenAI-compatible server (vLLM's `bench serve`)",
}


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    from minivllm.frontend.arg_utils import HelpFormatter

    p = sub.add_parser("bench", help="throughput, latency and serving benchmarks")
    bench_sub = p.add_subparsers(dest="bench_command", required=True)
    for name, help in COMMANDS.items():
        module = importlib.import_module(f"minivllm.benchmarks.{name}")
        cmd = bench_sub.add_parser(
            name,
            help=help,
            description=module.__doc__,
            formatter_class=HelpFormatter,
        )
        module.add_arguments(cmd)
        cmd.set_defaults(func=functools.partial(_run, module.main))


def run_script(
    description: str | None,
    add_arguments: Callable[[argparse.ArgumentParser], None] | None,
    main: Callable[[argparse.Namespace], Any],
    argv: Sequence[str] | None = None,
) -> None:
    """A benchmarks/ script's command line: its flags, then `main` (its figures to
    --output-json where the script has that flag)."""
    from minivllm.frontend.arg_utils import HelpFormatter

    parser = argparse.ArgumentParser(description=description, formatter_class=HelpFormatter)
    if add_arguments is not None:
        add_arguments(parser)
    _run(main, parser.parse_args(argv))


def _run(main: Callable[[argparse.Namespace], Any], args: argparse.Namespace) -> None:
    figures = main(args)
    if getattr(args, "output_json", None):
        with open(args.output_json, "w") as f:
            json.dump(figures, f, indent=2)
