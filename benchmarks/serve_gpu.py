"""`minivllm serve` against the engine without HTTP, on one GPU with dummy weights of the
Qwen3-0.6B geometry, in one call:

  1. offline: `LLM.generate` on the reference workload (as `bench throughput` does it);
  2. `AsyncLLM` in this process, one request at a time: TTFT over --ttft-prompts prompts of
     --ttft-input-len tokens (greedy, --ttft-output-len tokens each);
  3. `minivllm serve`, then `bench serve --dataset-name reference --max-concurrency 256`:
     output tok/s, target >= 85% of (1);
  4. the same server, `bench serve --max-concurrency 1` on the prompts of (2): TTFT through
     HTTP, target within 3 ms of (2) (medians).

Every engine has the same arguments (dummy weights, no tokenizer, max_model_len 4096) and
runs alone on the GPU. On a machine without one, `--geometry qwen3-cpu-tiny --num-prompts
16 --ttft-prompts 4` runs the same steps on the CPU as a smoke test.

    python benchmarks/serve_gpu.py [--output-json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_MODEL_LEN = 4096
TARGET_RATIO = 0.85
TARGET_TTFT_GAP_MS = 3.0
NUM_WARMUPS = 8
TTFT_SEED = 7  # the TTFT prompts: bench serve's random dataset with this seed


def offline_throughput(engine_args, num_prompts: int) -> float:
    from minivllm.benchmarks.throughput import print_vllm_lines, run_minivllm
    from minivllm.benchmarks.workloads import REFERENCE_TEMPERATURE, reference_workload
    from minivllm.frontend.llm import LLM

    workload = reference_workload().subset(num_prompts)
    llm = LLM(**asdict(engine_args))
    try:
        result = run_minivllm(llm, workload, REFERENCE_TEMPERATURE)
    finally:
        llm.shutdown()
    print_vllm_lines(result)
    return result.output_tokens_per_s


async def async_llm_ttfts(
    engine_args, prompts: list[list[int]], warm: list[list[int]], output_len: int
) -> list[float]:
    from minivllm import AsyncLLM, RequestOutputKind, SamplingParams

    llm = AsyncLLM.from_engine_args(engine_args)
    params = SamplingParams(
        max_tokens=output_len, temperature=0, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )

    async def one(prompt: list[int], request_id: str) -> float:
        start, first = time.perf_counter(), None
        async for _ in llm.generate({"prompt_token_ids": prompt}, params, request_id):
            if first is None:
                first = time.perf_counter() - start
        return first

    try:
        for i, prompt in enumerate(warm):  # what bench serve's --num-warmups sends
            await one(prompt, f"warm-{i}")
        return [await one(p, f"ttft-{i}") for i, p in enumerate(prompts)]
    finally:
        llm.shutdown()


def main() -> None:
    args = _parse_args()
    sys.path.insert(0, _REPO)
    import uvloop

    from minivllm.benchmarks import serve as bench_serve
    from minivllm.benchmarks.common import max_token_id
    from minivllm.benchmarks.geometry import write_geometry
    from minivllm.benchmarks.workloads import random_workload
    from minivllm.config import EngineArgs

    with tempfile.TemporaryDirectory(prefix="minivllm-serve-gpu-") as tmp:
        model = write_geometry(args.geometry, tmp)
        engine_args = EngineArgs(
            model=model, load_format="dummy", skip_tokenizer_init=True, max_model_len=MAX_MODEL_LEN
        )
        ttft_workload = random_workload(  # the same draw as bench serve's in step 4
            args.ttft_prompts,
            args.ttft_input_len,
            args.ttft_output_len,
            seed=TTFT_SEED,
            vocab_limit=max_token_id(model),
        )
        warm = bench_serve.warmups(ttft_workload, NUM_WARMUPS).prompts

        print(f"== 1. offline, LLM.generate, reference workload ({args.num_prompts} requests)")
        offline = offline_throughput(engine_args, args.num_prompts)
        print(f"== 2. AsyncLLM, concurrency 1, {args.ttft_prompts} x {args.ttft_input_len} tokens")
        direct = uvloop.run(
            async_llm_ttfts(engine_args, ttft_workload.prompts, warm, args.ttft_output_len)
        )
        print(f"AsyncLLM TTFT: median {1e3 * statistics.median(direct):.2f} ms")
        served, single = served_runs(args, model)
    figures = compare(args, offline, direct, served, single)
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(figures, f, indent=2)


def _parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--geometry", default="qwen3-0.6b")
    parser.add_argument("--num-prompts", type=int, default=256, help="of the reference workload")
    parser.add_argument("--max-concurrency", type=int, default=256)
    parser.add_argument("--ttft-prompts", type=int, default=64)
    parser.add_argument("--ttft-input-len", type=int, default=512)
    parser.add_argument("--ttft-output-len", type=int, default=16)
    parser.add_argument("--output-json", default=None)
    return parser.parse_args()


def served_runs(args: argparse.Namespace, model: str) -> tuple[dict, dict]:
    """Steps 3 and 4 against one `minivllm serve`: the result dicts of both bench serve runs."""
    from minivllm.benchmarks import serve as bench_serve
    from minivllm.frontend.server.launch import ServerProcess

    server_args = [model, "--load-format", "dummy", "--skip-tokenizer-init"]
    server_args += ["--max-model-len", str(MAX_MODEL_LEN), "--disable-uvicorn-access-log"]
    log_path = os.path.join(tempfile.gettempdir(), f"minivllm-serve-{os.getpid()}.log")
    with ServerProcess(server_args, log_path=log_path) as server:
        common = [
            "--base-url",
            server.url,
            "--tokenizer",
            model,
            "--num-warmups",
            str(NUM_WARMUPS),
        ]
        print(f"== 3. bench serve, reference workload, max concurrency {args.max_concurrency}")
        (served,) = bench_serve.run(
            [
                *common,
                *("--dataset-name", "reference", "--num-prompts", str(args.num_prompts)),
                *("--max-concurrency", str(args.max_concurrency)),
            ]
        )
        print("== 4. bench serve, concurrency 1, the prompts of step 2")
        (single,) = bench_serve.run(
            [
                *common,
                *("--num-prompts", str(args.ttft_prompts), "--max-concurrency", "1"),
                *("--random-input-len", str(args.ttft_input_len)),
                *("--random-output-len", str(args.ttft_output_len)),
                *("--ignore-eos", "--temperature", "0", "--seed", str(TTFT_SEED)),
            ]
        )
    return served, single


def compare(
    args: argparse.Namespace, offline: float, direct: list[float], served: dict, single: dict
) -> dict:
    """Print the comparison against the targets; the figures for --output-json."""
    ratio = served["output_throughput"] / offline
    direct_ms = 1e3 * statistics.median(direct)
    http_ms = single["median_ttft_ms"]
    gap = http_ms - direct_ms
    print("== comparison")
    print(f"offline LLM.generate:          {offline:,.0f} output tok/s")
    print(
        f"bench serve (HTTP, conc. {args.max_concurrency}): {served['output_throughput']:,.0f} "
        f"output tok/s = {100 * ratio:.1f}% of offline (target >= {100 * TARGET_RATIO:.0f}%): "
        f"{'met' if ratio >= TARGET_RATIO else 'MISSED'}"
    )
    print(
        f"TTFT at concurrency 1 (median): AsyncLLM {direct_ms:.2f} ms, HTTP {http_ms:.2f} ms, "
        f"gap {gap:+.2f} ms (target <= {TARGET_TTFT_GAP_MS:.0f} ms): "
        f"{'met' if gap <= TARGET_TTFT_GAP_MS else 'MISSED'}"
    )
    return {
        "offline_output_tokens_per_s": offline,
        "serve_output_tokens_per_s": served["output_throughput"],
        "serve_ratio": ratio,
        "async_llm_ttft_median_ms": direct_ms,
        "async_llm_ttft_mean_ms": 1e3 * statistics.mean(direct),
        "http_ttft_median_ms": http_ms,
        "http_ttft_mean_ms": single["mean_ttft_ms"],
        "serve_result": {k: v for k, v in served.items() if not isinstance(v, list)},
    }


if __name__ == "__main__":
    main()
