"""`minivllm bench latency`: end-to-end latency of one batch, printed like vLLM's
`vllm bench latency`, plus TTFT (the same batch with max_tokens=1) and
TPOT = (latency - TTFT) / (output_len - 1).

Every iteration uses fresh random prompts, so the prefix cache never serves a prefill and
TTFT measures a real one (vLLM's latency bench repeats one prompt).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np

from minivllm.benchmarks.common import (
    add_bench_args,
    max_token_id,
    model_dir,
    spec_decode_figures,
    start_llm,
    token_prompts,
)
from minivllm.benchmarks.workloads import random_workload
from minivllm.protocol.sampling_params import SamplingParams

PERCENTILES = (10, 25, 50, 75, 90, 99)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--input-len", type=int, default=32, help="prompt tokens of each request")
    p.add_argument("--output-len", type=int, default=128, help="output tokens of each")
    p.add_argument("--batch-size", type=int, default=8, help="requests per batch")
    p.add_argument("--num-iters-warmup", type=int, default=10, help="batches run untimed")
    p.add_argument("--num-iters", type=int, default=30, help="batches timed")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
    add_bench_args(p)


def _timed_batch(
    llm: Any, args: argparse.Namespace, seed: int, max_tokens: int, max_id: int
) -> float:
    batch = random_workload(args.batch_size, args.input_len, max_tokens, seed, max_id)
    params = SamplingParams(max_tokens=max_tokens, temperature=args.temperature, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(token_prompts(batch.prompts), params, use_tqdm=False)
    return time.perf_counter() - start


def main(args: argparse.Namespace) -> dict:
    if args.output_len < 2:
        raise SystemExit("--output-len must be at least 2 (TPOT needs a second token)")
    with model_dir(args) as (model, geometry):
        llm = start_llm(args, model, geometry, args.input_len + args.output_len)
        config = llm.llm_engine.config
        print(
            f"Model: {geometry or model}; device {config.device.device}, dtype "
            f"{config.model.dtype}; batch {args.batch_size} x ({args.input_len} in, "
            f"{args.output_len} out)"
        )
        max_id = max_token_id(model)
        seeds = iter(range(1_000_000, 2_000_000))  # fresh prompts for every batch
        try:
            for _ in range(args.num_iters_warmup):
                _timed_batch(llm, args, next(seeds), args.output_len, max_id)
            latencies = [
                _timed_batch(llm, args, next(seeds), args.output_len, max_id)
                for _ in range(args.num_iters)
            ]
            ttfts = [_timed_batch(llm, args, next(seeds), 1, max_id) for _ in range(args.num_iters)]
            spec = spec_decode_figures(llm)
        finally:
            llm.shutdown()
    avg = float(np.mean(latencies))
    ttft = float(np.median(ttfts))
    tpot = (avg - ttft) / (args.output_len - 1)
    print(f"Avg latency: {avg} seconds")
    pct = {p: float(np.percentile(latencies, p)) for p in PERCENTILES}
    for p, value in pct.items():
        print(f"{p}% percentile latency: {value} seconds")
    print(f"TTFT: {ttft * 1e3:.2f} ms (median, max_tokens=1)")
    print(f"TPOT: {tpot * 1e3:.2f} ms ((avg latency - TTFT) / (output_len - 1))")
    figures = {
        "avg_latency": avg,
        "latencies": latencies,
        "percentiles": pct,
        "ttft_s": ttft,
        "tpot_s": tpot,
        "device": config.device.device,
        **spec,
    }
    return figures
