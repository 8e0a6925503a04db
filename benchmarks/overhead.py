"""`python benchmarks/overhead.py`: what the engine costs around the model, on the CPU.

The null model (no forward pass) runs behind the full multiprocess pipeline: frontend
process -> engine-core process -> worker process. Measured:
  (a) output tokens/s through detokenization: N concurrent AsyncLLM streams (uvloop, DELTA
      outputs, ignore_eos), then the same through the sync LLM.generate;
  (b) per-step engine overhead: wall time / engine steps (the `stats` utility's
      step_counter);
  (c) IPC round trip: median of `health` utility calls on an idle engine.
--profile DIR records each process with py-spy (collapsed stacks) during run (a).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass
from typing import Any

from minivllm.benchmarks import run_script
from minivllm.benchmarks.null_checkpoint import build_null_checkpoint, register_null_model
from minivllm.config import EngineArgs
from minivllm.frontend.arg_utils import add_engine_args, engine_args_from
from minivllm.frontend.async_llm import AsyncLLM
from minivllm.frontend.llm import LLM
from minivllm.process_utils import freeze_startup_heap
from minivllm.protocol.sampling_params import RequestOutputKind, SamplingParams

TARGET_TOKENS_PER_S = 100_000
_PROMPT = "Engines schedule requests, run the model, and stream tokens back to clients. "


@dataclass
class StreamResult:
    tokens: int
    chars: int
    elapsed_s: float
    steps: int

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.elapsed_s

    @property
    def step_us(self) -> float:
        return 1e6 * self.elapsed_s / max(self.steps, 1)

    def figures(self, prefix: str) -> dict[str, Any]:
        names = ("tokens", "elapsed_s", "tokens_per_s", "steps", "step_us")
        return {f"{prefix}_{name}": getattr(self, name) for name in names}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-requests", type=int, default=256, help="streams")
    p.add_argument("--output-len", type=int, default=512, help="tokens of each")
    p.add_argument("--health-calls", type=int, default=2000, help="utility round trips timed")
    p.add_argument("--skip-sync", action="store_true", help="skip the LLM.generate run")
    p.add_argument("--profile", default=None, metavar="DIR", help="py-spy each process")
    p.add_argument("--output-json", default=None, help="write the figures to this file")
    add_engine_args(p, model_required=False)


def _prompts(n: int) -> list[str]:
    return [f"{i}: {_PROMPT}" for i in range(n)]


async def _stream(llm: Any, prompt: str, params: Any, request_id: str) -> tuple[int, int]:
    tokens = chars = 0
    async for out in llm.generate(prompt, params, request_id):
        tokens += len(out.outputs[0].token_ids)
        chars += len(out.outputs[0].text)
    return tokens, chars


async def run_async(
    engine_args: EngineArgs, args: argparse.Namespace
) -> tuple[StreamResult, list[float]]:
    """(stream result, health round trips in seconds) from one AsyncLLM."""
    llm = AsyncLLM.from_engine_args(engine_args)
    freeze_startup_heap()  # the bench command's own process
    output_len = args.output_len
    params = SamplingParams(
        max_tokens=output_len, temperature=0.0, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )
    try:
        warm = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
        await asyncio.gather(
            *(_stream(llm, p, warm, f"warm-{i}") for i, p in enumerate(_prompts(8)))
        )
        rtts = []
        for _ in range(args.health_calls):
            start = time.perf_counter()
            await llm.check_health()
            rtts.append(time.perf_counter() - start)
        before = (await llm.get_stats())["step_counter"]
        spies = _start_py_spy(args.profile) if args.profile else []
        start = time.perf_counter()
        counts = await asyncio.gather(
            *(_stream(llm, p, params, f"r{i}") for i, p in enumerate(_prompts(args.num_requests)))
        )
        elapsed = time.perf_counter() - start
        _stop_py_spy(spies)
        steps = (await llm.get_stats())["step_counter"] - before
        if engine_args.data_parallel_size > 1:  # steps are summed over the engine-cores
            print(f"Routing balance (per engine-core): {llm.client.balance()}")
    finally:
        llm.shutdown()
    short = {i: t for i, (t, _) in enumerate(counts) if t != output_len}
    if short:  # a benchmark that miscounts is worse than none: say so loudly
        print(f"WARNING: {len(short)} streams did not get {output_len} tokens: {short}")
    tokens = sum(t for t, _ in counts)
    return StreamResult(tokens, sum(c for _, c in counts), elapsed, steps), rtts


def run_sync(engine_args: EngineArgs, args: argparse.Namespace) -> StreamResult:
    llm = LLM(**{f: getattr(engine_args, f) for f in EngineArgs.field_names()})
    freeze_startup_heap()
    try:
        llm.generate(_prompts(8), SamplingParams(max_tokens=16, temperature=0.0), use_tqdm=False)
        before = llm.llm_engine.get_stats()["step_counter"]
        params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
        start = time.perf_counter()
        outs = llm.generate(_prompts(args.num_requests), params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        steps = llm.llm_engine.get_stats()["step_counter"] - before
    finally:
        llm.shutdown()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return StreamResult(tokens, sum(len(o.outputs[0].text) for o in outs), elapsed, steps)


def _start_py_spy(out_dir: str) -> list[subprocess.Popen]:
    """py-spy on this process and its descendants (engine-core, workers), raw stacks."""
    import psutil

    if shutil.which("py-spy") is None:
        print("--profile: py-spy is not installed (pip install py-spy); not profiling")
        return []
    os.makedirs(out_dir, exist_ok=True)
    me = psutil.Process()
    procs = [me] + [c for c in me.children(recursive=True) if "python" in c.name().lower()]
    spies = []
    for proc in procs:
        name = "frontend" if proc.pid == me.pid else f"child-{proc.pid}"
        cmd = ["py-spy", "record", "--pid", str(proc.pid), "--format", "raw", "--rate", "250"]
        cmd += ["--output", os.path.join(out_dir, f"{name}.txt"), "--nonblocking"]
        spies.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    time.sleep(1.0)  # let py-spy attach before the timed run
    return spies


def _stop_py_spy(spies: list[subprocess.Popen]) -> None:
    for spy in spies:
        spy.send_signal(signal.SIGINT)  # py-spy writes its output on SIGINT
    for spy in spies:
        spy.wait(timeout=30)


def _report(label: str, r: StreamResult) -> None:
    print(
        f"{label}: {r.tokens} output tokens ({r.chars} chars) in {r.elapsed_s:.2f} s = "
        f"{r.tokens_per_s:,.0f} output tok/s; {r.steps} engine steps, "
        f"{r.step_us:.0f} µs per step"
    )


def main(args: argparse.Namespace) -> dict:
    import uvloop

    register_null_model()  # also for --model DIR: a null checkpoint of one's own
    with tempfile.TemporaryDirectory(prefix="minivllm-null-") as tmp:
        model = args.model or build_null_checkpoint(tmp)
        overrides: dict[str, Any] = {"model": model}
        if args.num_gpu_blocks_override is None:
            # the null model's KV is tiny: a byte budget would mean millions of blocks
            per_req = -(-(64 + args.output_len) // args.block_size)
            overrides["num_gpu_blocks_override"] = 2 * args.num_requests * per_req
        engine_args = engine_args_from(args, **overrides)
        print(
            f"Null model behind frontend -> engine-core -> worker processes; "
            f"{args.num_requests} requests x {args.output_len} output tokens, greedy, ignore_eos"
        )
        result, rtts = uvloop.run(run_async(engine_args, args))
        _report("AsyncLLM (uvloop, DELTA streams)", result)
        met = "met" if result.tokens_per_s >= TARGET_TOKENS_PER_S else "MISSED"
        print(f"Target >= {TARGET_TOKENS_PER_S:,} output tok/s: {met}")
        rtt_us = sorted(r * 1e6 for r in rtts)
        median = statistics.median(rtt_us)
        p90 = rtt_us[int(0.9 * (len(rtt_us) - 1))]
        print(
            f"IPC round trip (health utility, {len(rtts)} calls): median {median:.0f} µs, p90 {p90:.0f} µs"
        )
        figures = result.figures("async")
        figures.update(health_rtt_median_us=median, health_rtt_p90_us=p90)
        if not args.skip_sync:
            sync = run_sync(engine_args, args)
            _report("LLM.generate (sync)", sync)
            figures.update(sync.figures("sync"))
    return figures


if __name__ == "__main__":
    run_script(__doc__, add_arguments, main)
