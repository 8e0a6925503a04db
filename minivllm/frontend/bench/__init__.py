"""`minivllm bench ...`: benchmarks whose output reads like vLLM's."""

from __future__ import annotations

import argparse


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="throughput, latency, serving and engine-overhead benchmarks")
    bench_sub = p.add_subparsers(dest="bench_command", required=True)
    from minivllm.frontend.bench import (
        allreduce,
        grammar,
        kernels,
        kv_accuracy,
        latency,
        overhead,
        serve,
        step,
        throughput,
        tp_equality,
        trace,
    )

    throughput.add_parser(bench_sub)
    latency.add_parser(bench_sub)
    serve.add_parser(bench_sub)
    overhead.add_parser(bench_sub)
    kv_accuracy.add_parser(bench_sub)
    step.add_parser(bench_sub)
    kernels.add_parser(bench_sub)
    trace.add_parser(bench_sub)
    grammar.add_parser(bench_sub)
    tp_equality.add_parser(bench_sub)
    allreduce.add_parser(bench_sub)
