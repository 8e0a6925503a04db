"""Data-parallel scaling: data_parallel_size=2 against 1 in one call, every token counted.

    python benchmarks/dp_scaling.py                  # one engine-core per GPU (2 GPUs)
    python benchmarks/dp_scaling.py --shared-gpu     # two engine-cores on ONE GPU
    python benchmarks/dp_scaling.py --device cpu --geometry qwen3-cpu-tiny \\
        --num-prompts 32 --big-num-prompts 64 --lengths 16 64      # a quick CPU check

Runs, on dummy weights of a real geometry (Qwen3-0.6B by default), temperature 0.6,
ignore_eos:
  reference  the reference workload (256 requests, 133,966 output tokens) at DP=1, then DP=2;
  big        1,024 requests of the reference length distribution (seed 1), where one GPU's
             KV cache is the limit; each DP=2 run prints the routing balance (requests and
             output tokens per engine-core);
  kill       DP=2 on the reference workload, SIGKILL of engine-core 1 once both stream and
             a quarter of the output tokens are delivered:
             its unfinished requests move to engine-core 0 (failover) and all must finish
             with every token; prints how many moved, the time from the kill until a moved
             request streams again, and the time to finish against the DP=2 reference run.
One DP=1 engine serves the first two runs, one DP=2 engine all three (start-ups are the
slow part). --shared-gpu puts both engine-cores of DP=2 on GPU 0 with
gpu_memory_utilization 0.45 each (DP=1 keeps 0.9). Exits 1 if any token is missing.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import tempfile
import time
from typing import Any

# kept in every process (children inherit them): multicast NVLink is off on the lent machines
for _name in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
    os.environ.setdefault(_name, "0" if _name == "NCCL_NVLS_ENABLE" else "1")


def length_workload(n: int, seed: int, lo: int, hi: int) -> tuple[list[list[int]], list[int]]:
    """The reference draw: n prompts of randint(lo, hi) ids of randint(0, 10000), then n
    output lengths randint(lo, hi). n=256, seed=0, (100, 1024) is the reference workload."""
    rng = random.Random(seed)
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(lo, hi))] for _ in range(n)]
    return prompts, [rng.randint(lo, hi) for _ in range(n)]


def _balance_delta(llm: Any, before: list[dict]) -> list[dict]:
    now = llm.llm_engine.engine_core.balance()
    return [
        {
            "requests": a["requests"] - b["requests"],
            "output_tokens": a["output_tokens"] - b["output_tokens"],
        }
        for a, b in zip(now, before, strict=True)
    ]


def timed_run(llm: Any, name: str, prompts: list[list[int]], lens: list[int]) -> dict:
    from minivllm import SamplingParams

    dp = llm.llm_engine.config.parallel.data_parallel_size
    params = [SamplingParams(max_tokens=n, temperature=0.6, ignore_eos=True) for n in lens]
    before = llm.llm_engine.engine_core.balance() if dp > 1 else None
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    short = sum(len(o.outputs[0].token_ids) != n for o, n in zip(outs, lens, strict=True))
    result = {
        "run": name,
        "dp": dp,
        "requests": len(outs),
        "output_tokens": produced,
        "expected_tokens": sum(lens),
        "short_requests": short,
        "elapsed_s": elapsed,
        "output_tok_per_s": produced / elapsed,
    }
    if before is not None:
        result["balance"] = _balance_delta(llm, before)
    print(
        f"{name} DP={dp}: {len(outs)} requests, {produced:,} / {sum(lens):,} output tokens in "
        f"{elapsed:.2f} s = {produced / elapsed:,.0f} output tok/s"
        + (f"; balance {result['balance']}" if before is not None else "")
    )
    return result


def kill_run(
    llm: Any, prompts: list[list[int]], lens: list[int], reference_s: float | None
) -> dict:
    """Kill engine-core 1 a quarter into the run, through the step API: its unfinished requests move to
    engine-core 0 and every request must finish with every token. `reference_s`: the same
    workload's time at DP=2 without a kill."""
    from minivllm import SamplingParams
    from minivllm.exceptions import EngineCoreDeadError

    engine = llm.llm_engine
    client = engine.engine_core
    start = time.perf_counter()
    for i, (p, n) in enumerate(zip(prompts, lens, strict=True)):
        params = SamplingParams(max_tokens=n, temperature=0.6, ignore_eos=True)
        engine.add_request(f"k{i}", {"prompt_token_ids": p}, params)
    owner = {
        f"k{i}": client.router.owner[engine.output_processor.get_internal_ids(f"k{i}")[0]]
        for i in range(len(prompts))
    }
    tokens: dict[str, int] = {}
    quarter = sum(lens) // 4  # the kill comes once both stream and a quarter is delivered
    streaming: set[int] = set()
    killed_at = moved_at = None
    errors: list[str] = []
    while engine.has_unfinished_requests():
        try:
            outs = engine.step()
        except EngineCoreDeadError as e:
            errors.append(str(e))
            continue
        for o in outs:
            tokens[o.request_id] = len(o.outputs[0].token_ids)
            if killed_at is None:
                streaming.add(owner[o.request_id])
            elif moved_at is None and owner[o.request_id] == 1:
                moved_at = time.perf_counter()  # engine-core 0 streams a moved request
        if killed_at is None and streaming == {0, 1} and sum(tokens.values()) >= quarter:
            killed_at = time.perf_counter()
            os.kill(client.clients[1].proc.pid, signal.SIGKILL)
    elapsed = time.perf_counter() - start
    complete = sum(tokens.get(r) == n for r, n in zip(owner, lens, strict=True))
    stats = client.failover.stats
    result = {
        "run": "kill",
        "requests": len(owner),
        "requests_complete": complete,
        "output_tokens": sum(tokens.values()),
        "expected_tokens": sum(lens),
        "requests_moved": stats.moved[1],
        "requests_failed": sum(stats.failed),
        "errors": errors,
        "seconds_to_kill": None if killed_at is None else killed_at - start,
        "seconds_kill_to_moved_token": None if moved_at is None else moved_at - killed_at,
        "elapsed_s": elapsed,
        "reference_elapsed_s": reference_s,
    }
    moved = result["seconds_kill_to_moved_token"]
    versus = (
        ""
        if reference_s is None
        else f" (without the kill: {reference_s:.2f} s, {elapsed / reference_s:.2f}x)"
    )
    print(
        f"kill: engine-core 1 killed {result['seconds_to_kill'] or 0:.2f} s in; "
        f"{stats.moved[1]} requests moved to engine-core 0, the first streaming again after "
        f"{'never' if moved is None else f'{moved:.2f} s'}; {sum(stats.failed)} failed; "
        f"{complete} of {len(owner)} requests finished with every token "
        f"({result['output_tokens']:,} / {sum(lens):,}) in {elapsed:.2f} s{versus}"
    )
    return result


def main() -> int:
    from minivllm import LLM
    from minivllm.benchmarks.geometry import write_geometry
    from minivllm.benchmarks.workloads import reference_workload

    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--geometry", default="qwen3-0.6b")
    p.add_argument("--device", default="auto")
    p.add_argument("--shared-gpu", action="store_true", help="both engine-cores on GPU 0")
    p.add_argument("--gpu-memory-utilization", type=float, default=None)
    p.add_argument("--runs", default="reference,big,kill")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--big-num-prompts", type=int, default=1024)
    p.add_argument("--lengths", type=int, nargs=2, default=[100, 1024], metavar=("LO", "HI"))
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    runs = args.runs.split(",")
    if args.shared_gpu:
        os.environ["CUDA_VISIBLE_DEVICES"] = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[
            0
        ]
    lo, hi = args.lengths
    ref = length_workload(args.num_prompts, 0, lo, hi)
    if (args.num_prompts, lo, hi) == (256, 100, 1024):
        w = reference_workload()  # checks the totals
        assert (ref[0], ref[1]) == (w.prompts, w.output_lens)
    big = length_workload(args.big_num_prompts, 1, lo, hi)
    max_len = max(len(q) + n for q, n in zip(ref[0] + big[0], ref[1] + big[1], strict=True))
    results: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        model = write_geometry(args.geometry, tmp)
        common = dict(
            load_format="dummy",
            skip_tokenizer_init=True,
            device=args.device,
            max_model_len=max(4096, max_len),
        )
        for dp in (1, 2):
            util = args.gpu_memory_utilization or (0.45 if args.shared_gpu and dp == 2 else 0.9)
            start = time.perf_counter()
            llm = LLM(model, data_parallel_size=dp, gpu_memory_utilization=util, **common)
            print(
                f"DP={dp}: started in {time.perf_counter() - start:.1f} s (gpu_memory_utilization {util})"
            )
            try:
                warm = length_workload(8, 12345, 16, 32)
                timed_run(llm, "warm-up", *warm)
                if "reference" in runs:
                    results.append(timed_run(llm, "reference", *ref))
                if "big" in runs:
                    results.append(timed_run(llm, f"big ({len(big[0])} requests)", *big))
                if dp == 2 and "kill" in runs:
                    reference_s = next(
                        (
                            r["elapsed_s"]
                            for r in results
                            if r["run"] == "reference" and r["dp"] == 2
                        ),
                        None,
                    )
                    results.append(kill_run(llm, *ref, reference_s))
            finally:
                llm.shutdown()
    by = {(r["run"], r.get("dp")): r for r in results}
    for name in ("reference", f"big ({len(big[0])} requests)"):
        one, two = by.get((name, 1)), by.get((name, 2))
        if one and two:
            print(f"{name}: DP=2 / DP=1 = {two['output_tok_per_s'] / one['output_tok_per_s']:.2f}x")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(results, f, indent=2)
    missing = [r for r in results if r.get("short_requests")]
    kill = by.get(("kill", None))
    bad_kill = kill is not None and (
        kill["requests_complete"] != kill["requests"] or kill["seconds_to_kill"] is None
    )
    return 1 if missing or bad_kill else 0


if __name__ == "__main__":
    sys.exit(main())
