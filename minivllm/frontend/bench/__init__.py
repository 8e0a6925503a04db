"""`minivllm bench ...`: benchmarks whose output reads like vLLM's."""

from __future__ import annotations

import argparse


def add_bench_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="throughput, latency, serving and engine-overhead benchmarks")
    bench_sub = p.add_subparsers(dest="bench_command", required=True)
    from minivllm.frontend.bench import latency, overhead, serve, throughput

    throughput.add_parser(bench_sub)
    latency.add_parser(bench_sub)
    serve.add_parser(bench_sub)
    overhead.add_parser(bench_sub)
