"""`python benchmarks/step.py`: where one model-runner step's time goes, without the engine
around it.

The model runner runs in this process on one GPU, on a geometry with random weights.
Decode (the default): --num sequences decode over --ctx tokens of context each (the KV is
garbage: only the time matters). With --prefill N: one fresh N-token prompt per step and its
first sample, the worker's share of a batch-1 TTFT (the rest is the frontend, the hops
between processes and the scheduler: compare with `minivllm bench latency`).

Prints the wall time per step (decode: queued back to back; prefill: one at a time, the GPU
idle before each), the host time to launch one, and a profile of a few steps by GPU time
(--profile-sort cpu: by host time, where the launch overhead goes).
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from minivllm.benchmarks import run_script
from minivllm.benchmarks.common import add_bench_args, bench_engine_args, model_dir
from minivllm.protocol.messages import CachedRequestData, NewRequestData, SchedulerOutput
from minivllm.protocol.sampling_params import SamplingParams


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num", type=int, default=256, help="decode: sequences per step")
    p.add_argument("--ctx", type=int, default=1000, help="decode: context tokens of each")
    p.add_argument("--prefill", type=int, default=0, help="time N-token prompts instead")
    p.add_argument("--steps", type=int, default=50, help="steps timed")
    p.add_argument(
        "--profile-sort", choices=["cuda", "cpu"], default="cuda", help="sort the profile by"
    )
    p.add_argument(
        "--profile-trace", default=None, help="also write the profile as a Chrome trace (JSON)"
    )
    add_bench_args(p, output_json=False)


class StepDriver:
    """Feeds the runner SchedulerOutputs as the scheduler would for these shapes."""

    def __init__(self, runner: Any, num: int, ctx: int, prefill: int, blocks_per_seq: int) -> None:
        self.runner, self.num, self.ctx, self.prefill = runner, num, ctx, prefill
        self.ids = [str(i) for i in range(num)]  # of the decoding sequences
        self.blocks_per_seq = blocks_per_seq
        self.params = SamplingParams(temperature=0.6, max_tokens=1 << 20, ignore_eos=True)
        self.rng = random.Random(0)
        self.step_id = 0
        self.last_prefill: str | None = None

    def _prompt(self, n: int) -> list[int]:
        return [self.rng.randint(0, 10000) for _ in range(n)]

    def start_decodes(self) -> Any:
        bps = self.blocks_per_seq
        new = [
            NewRequestData(
                rid, self._prompt(self.ctx), self.ctx, self.params,
                list(range(i * bps, (i + 1) * bps)), self.ctx - 1,
            )
            for i, rid in enumerate(self.ids)
        ]  # fmt: skip
        return self._launch(new, dict.fromkeys(self.ids, 1))

    def decode(self) -> Any:
        computed = [self.ctx - 1 + self.step_id] * self.num
        cached = CachedRequestData(self.ids, [[] for _ in self.ids], computed)
        return self._launch([], dict.fromkeys(self.ids, 1), cached)

    def prompt(self) -> Any:
        """A fresh prompt in blocks 0.. (the previous one is finished first)."""
        rid = f"p{self.step_id}"
        blocks = list(range(-(-self.prefill // self.runner.block_size)))
        new = NewRequestData(rid, self._prompt(self.prefill), self.prefill, self.params, blocks, 0)
        finished = [self.last_prefill] if self.last_prefill else []
        self.last_prefill = rid
        return self._launch([new], {rid: self.prefill}, finished=finished)

    def _launch(self, new: list, scheduled: dict, cached: Any = None, finished: Any = ()) -> Any:
        so = SchedulerOutput(
            self.step_id,
            scheduled_new_reqs=new,
            scheduled_cached_reqs=cached or CachedRequestData(),
            num_scheduled_tokens=scheduled,
            total_num_scheduled_tokens=sum(scheduled.values()),
            finished_req_ids=list(finished),
        )
        self.step_id += 1
        self.runner.execute_model(so)
        return self.runner.sample_tokens()


def _gpu_ms(fn: Any, reps: int = 20) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def main(args: argparse.Namespace) -> dict:
    from minivllm.worker.worker import Worker

    figures: dict[str, Any] = {}
    with model_dir(args) as (model, geometry):
        max_len = max(4096, args.ctx + args.steps + 64, args.prefill + 64)
        engine_args = bench_engine_args(
            args, model, geometry, max_model_len=max_len, distributed_executor_backend="uni"
        )
        config = engine_args.create_engine_config()
        cuda = config.device.device == "cuda"
        worker = Worker(config)
        worker.init_device()
        worker.load_model()
        blocks_per_seq = -(-(args.ctx + args.steps + 16) // config.cache.block_size)
        num = 1 if args.prefill else args.num
        worker.initialize_kv_cache(max(num * blocks_per_seq, max_len // 16) + 1)
        runner = worker.model_runner
        driver = StepDriver(runner, num, args.ctx, args.prefill, blocks_per_seq)
        step = driver.prompt if args.prefill else driver.decode
        if not args.prefill:
            driver.start_decodes().get()
        for _ in range(5):
            step().get()
        host, walls = 0.0, []
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            t = time.perf_counter()
            out = step()
            host += time.perf_counter() - t
            if args.prefill:  # one at a time, as a batch-1 TTFT runs
                out.get()
                walls.append(time.perf_counter() - t)
        out.get()
        wall = (time.perf_counter() - t0) / args.steps
        if args.prefill:
            walls.sort()
            wall = walls[len(walls) // 2]
            what = f"prefill of {args.prefill} tokens + first sample: {wall * 1e3:.2f} ms (median)"
        else:
            what = f"decode step, {num} seqs x {args.ctx} ctx: {wall * 1e3:.2f} ms/step queued"
        print(what)
        print(f"  host launch {host / args.steps * 1e3:.2f} ms/step")
        figures.update(wall_ms=wall * 1e3, host_ms=host / args.steps * 1e3)
        if cuda and runner.use_graphs and not args.prefill:
            size = runner.graphs.decode.padded_size(num)
            replay = _gpu_ms(lambda: runner.graphs.decode.replay(size))
            print(f"  graph replay (B={size}) GPU {replay:.2f} ms")
            figures["graph_replay_ms"] = replay
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            for _ in range(5):
                out = step()
                if args.prefill:
                    out.get()
            out.get()
        sort = "cuda_time_total" if args.profile_sort == "cuda" and cuda else "cpu_time_total"
        print(prof.key_averages().table(sort_by=sort, row_limit=25, max_name_column_width=60))
        if args.profile_trace:
            prof.export_chrome_trace(args.profile_trace)
    return figures


if __name__ == "__main__":
    run_script(__doc__, add_arguments, main)
