"""Where a decode step's time goes: the model runner alone, on Qwen3-0.6B's geometry.

256 requests with a 1000-token context (its KV is left as garbage: only the time matters)
decode step after step. Prints the wall time per step when steps are queued back to back,
the host time to launch one, the GPU time of the graph replay and of the sampler, and a
profiler table of the kernels.

    python benchmarks/probe_decode_step.py [--num 256] [--ctx 1000] [--eager]
"""

from __future__ import annotations

import json
import os
import random
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from probe_gpu_runner import QWEN3_0_6B  # noqa: E402

from minivllm.config import EngineArgs  # noqa: E402
from minivllm.protocol.messages import (  # noqa: E402
    CachedRequestData,
    NewRequestData,
    SchedulerOutput,
)
from minivllm.protocol.sampling_params import SamplingParams  # noqa: E402
from minivllm.worker.sampler import SamplingMetadata  # noqa: E402
from minivllm.worker.worker import Worker  # noqa: E402


def _arg(name: str, default: int) -> int:
    return int(sys.argv[sys.argv.index(name) + 1]) if name in sys.argv else default


# --num 1 --ctx 512: the batch-1 latency shape
NUM, CTX = _arg("--num", 256), _arg("--ctx", 1000)
BLOCKS = -(-(CTX + 120) // 16)  # room for the steps run here


def gpu_ms(fn, reps: int = 20) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def main() -> None:
    model_dir = tempfile.mkdtemp()
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(QWEN3_0_6B, f)
    args = EngineArgs(
        model=model_dir,
        load_format="dummy",
        max_model_len=4096,
        distributed_executor_backend="uni",
        enforce_eager="--eager" in sys.argv,
    )
    worker = Worker(args.create_engine_config())
    worker.init_device()
    worker.load_model()
    worker.initialize_kv_cache(NUM * BLOCKS + 1)
    runner = worker.model_runner
    params = SamplingParams(temperature=0.6, max_tokens=4000, ignore_eos=True)
    rng = random.Random(0)
    new = [
        NewRequestData(
            str(i),
            [rng.randint(0, 10000) for _ in range(CTX)],
            CTX,
            params,
            list(range(i * BLOCKS, (i + 1) * BLOCKS)),
            CTX - 1,
        )
        for i in range(NUM)
    ]
    ids = [str(i) for i in range(NUM)]
    step_id = 0

    def step(first: bool = False):
        nonlocal step_id
        so = SchedulerOutput(
            step_id,
            scheduled_new_reqs=new if first else [],
            scheduled_cached_reqs=CachedRequestData()
            if first
            else CachedRequestData(ids, [[] for _ in ids], [CTX - 1 + step_id] * NUM),
            num_scheduled_tokens=dict.fromkeys(ids, 1),
            total_num_scheduled_tokens=NUM,
        )
        step_id += 1
        return runner.execute_model_async(so)

    step(first=True).get()
    for _ in range(5):
        step().get()
    n, host = 50, 0.0
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        t = time.perf_counter()
        out = step()
        host += time.perf_counter() - t
    out.get()
    wall = (time.perf_counter() - t0) / n
    print(f"decode step, {NUM} seqs x {CTX} ctx: {wall * 1e3:.2f} ms/step queued back to back, ")
    print(f"  host launch {host / n * 1e3:.2f} ms/step")
    if runner.use_graphs:
        print(f"  graph replay (B={NUM}) GPU {gpu_ms(lambda: runner.graphs.replay(NUM)):.2f} ms")
    hidden = torch.randn(NUM, 1024, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        print(f"  lm_head GPU {gpu_ms(lambda: runner.model.compute_logits(hidden)):.3f} ms")
        logits = runner.model.compute_logits(hidden)
        meta = SamplingMetadata.from_buffers(runner.buffers, NUM)
        print(f"  sampler GPU {gpu_ms(lambda: runner.sampler.sample_logits(logits, meta)):.3f} ms")
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            out = step()
        out.get()
    print(
        prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60)
    )


if __name__ == "__main__":
    main()
