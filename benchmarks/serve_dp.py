"""HTTP data parallelism on GPUs: `minivllm serve -dp M --api-server-count M` for each M of
--dp (default 1 then 2), on dummy weights of a real geometry (Qwen3-0.6B), loaded by
`bench serve` with the reference workload at one concurrency; the output tok/s of each and
its ratio to the first (target: DP=2 >= 1.8x of DP=1 on two GPUs).

    python benchmarks/serve_dp.py                      # two GPUs: DP=1, then DP=2
    python benchmarks/serve_dp.py --device cpu --geometry qwen3-cpu-tiny --num-prompts 16 \\
        --max-concurrency 16                           # a quick CPU check of the steps

Each server runs alone; its log goes to $OUT (or the temporary directory).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET = 1.8  # DP=2 against DP=1
NUM_WARMUPS = 8


def served_throughput(model: str, dp: int, args: argparse.Namespace, log_dir: str) -> dict:
    """One server of `dp` engine-cores and as many API processes under the reference
    workload: bench serve's result."""
    from minivllm.benchmarks import serve as bench_serve
    from minivllm.frontend.server.launch import ServerProcess

    server_args = [model, "--load-format", "dummy", "--skip-tokenizer-init"]
    server_args += ["--max-model-len", str(args.max_model_len), "--device", args.device]
    server_args += ["-dp", str(dp), "--api-server-count", str(dp)]
    server_args += ["--disable-uvicorn-access-log"]
    log = os.path.join(log_dir, f"server-dp{dp}.log")
    with ServerProcess(server_args, log_path=log, startup_timeout=600) as server:
        (result,) = bench_serve.run(
            [
                *("--base-url", server.url, "--tokenizer", model),
                *("--num-warmups", str(NUM_WARMUPS), "--dataset-name", "reference"),
                *("--num-prompts", str(args.num_prompts)),
                *("--max-concurrency", str(args.max_concurrency)),
            ]
        )
    return result


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--dp", default="1,2", help="data-parallel sizes, comma-separated")
    p.add_argument("--geometry", default="qwen3-0.6b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--num-prompts", type=int, default=256, help="of the reference workload")
    p.add_argument("--max-concurrency", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    sys.path.insert(0, _REPO)
    from minivllm.benchmarks.geometry import write_geometry

    runs = []
    with tempfile.TemporaryDirectory(prefix="minivllm-serve-dp-") as tmp:
        model = write_geometry(args.geometry, tmp)
        for dp in (int(x) for x in args.dp.split(",")):
            result = served_throughput(model, dp, args, os.environ.get("OUT", tmp))
            runs.append({"data_parallel_size": dp, **result})
            ratio = result["output_throughput"] / runs[0]["output_throughput"]
            verdict = f" (target >= {TARGET}x: {'met' if ratio >= TARGET else 'MISSED'})"
            print(
                f"DP={dp} with {dp} API: {result['total_output_tokens']:,} output tokens, "
                f"{result['output_throughput']:,.0f} output tok/s, {ratio:.2f}x of DP="
                f"{runs[0]['data_parallel_size']}{verdict if dp == 2 else ''}; failed "
                f"{result['failed']}",
                flush=True,
            )
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(runs, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
