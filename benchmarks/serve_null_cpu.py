"""Streamed tokens through HTTP with the null model (no forward pass), on the CPU.

`minivllm serve` over the null checkpoint (a real BPE tokenizer, so every token is
detokenized), then `bench serve` from this process: N concurrent streams of L greedy tokens
(ignore_eos), all sent at once, several runs. What it measures is everything around the
model: HTTP, SSE, detokenization, the engine-core and worker processes, and the client.
Target: >= 30,000 output tok/s.

    python benchmarks/serve_null_cpu.py [--num-prompts 256] [--output-len 512] [--runs 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET_TOKENS_PER_S = 30_000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--input-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=512)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    sys.path.insert(0, _REPO)
    from minivllm.benchmarks import serve as bench_serve
    from minivllm.benchmarks.null_checkpoint import build_null_checkpoint, null_model_env
    from minivllm.frontend.server.launch import ServerProcess

    # the server is a process on its own: the null model is its plugin
    env = null_model_env(os.environ)
    with tempfile.TemporaryDirectory(prefix="minivllm-null-") as tmp:
        model = build_null_checkpoint(tmp)
        blocks = 2 * args.num_prompts * -(-(args.input_len + args.output_len) // 16)
        server_args = [model, "--num-gpu-blocks-override", str(blocks)]
        with ServerProcess([*server_args, "--disable-uvicorn-access-log"], env=env) as server:
            print(f"minivllm serve (null model) at {server.url}; load average {os.getloadavg()}")
            throughputs = []
            for run in range(args.runs):
                print(f"--- run {run + 1} of {args.runs}")
                (result,) = bench_serve.run(
                    [
                        *("--base-url", server.url, "--tokenizer", model),
                        *("--num-prompts", str(args.num_prompts), "--ignore-eos"),
                        *("--random-input-len", str(args.input_len)),
                        *("--random-output-len", str(args.output_len)),
                        *("--temperature", "0", "--seed", str(run)),
                    ]
                )
                throughputs.append(result["output_throughput"])
    best, median = max(throughputs), statistics.median(throughputs)
    print(
        f"Streamed output tok/s over {args.runs} runs: "
        + ", ".join(f"{t:,.0f}" for t in throughputs)
        + f"; median {median:,.0f}, best {best:,.0f}; load average {os.getloadavg()}"
    )
    met = "met" if median >= TARGET_TOKENS_PER_S else "MISSED"
    print(f"Target >= {TARGET_TOKENS_PER_S:,} streamed tok/s (median): {met}")


if __name__ == "__main__":
    main()
