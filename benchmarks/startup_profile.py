"""Where start-up time goes: each phase of bringing up one worker in this process (imports,
device, weights, memory profile, KV cache and CUDA graphs), each under cProfile, then the
whole `LLM(...)` start to ready as a user sees it.

    python benchmarks/startup_profile.py [--geometry qwen3-0.6b] [--out DIR]
    python benchmarks/startup_profile.py --no-phases --ready-runs 3   # a fresh machine: the
        # first start compiles every Triton kernel, the next two find them cached

Writes phases.json and one profile text per phase (top functions by cumulative time) to
--out (default: $OUT or ./startup-profile).
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import io
import json
import os
import pstats
import tempfile
import time


def _profiled(name: str, fn, out: str, phases: dict[str, float]):
    prof = cProfile.Profile()
    start = time.perf_counter()
    prof.enable()
    result = fn()
    prof.disable()
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    phases[name] = time.perf_counter() - start
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(40)
    with open(
        os.path.join(out, f"profile_{name.replace(' ', '_').replace('+', 'and')}.txt"), "w"
    ) as f:
        f.write(text.getvalue())
    print(f"{name:>18}: {phases[name]:7.2f} s", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--geometry", default="qwen3-0.6b")
    parser.add_argument("--out", default=os.environ.get("OUT", "startup-profile"))
    parser.add_argument("--no-phases", action="store_true", help="only time LLM() to ready")
    parser.add_argument("--ready-runs", type=int, default=1, help="LLM() starts, one by one")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    phases: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        from minivllm.benchmarks.geometry import write_geometry

        model = write_geometry(args.geometry, tmp)
        if not args.no_phases:
            _worker_phases(model, args.out, phases)
        from minivllm import LLM

        for i in range(1, args.ready_runs + 1):
            start = time.perf_counter()
            llm = LLM(model=model, load_format="dummy", skip_tokenizer_init=True)
            phases[f"LLM() to ready #{i}"] = took = time.perf_counter() - start
            print(f"{'LLM() to ready':>15} #{i}: {took:7.2f} s", flush=True)
            llm.shutdown()
    with open(os.path.join(args.out, "phases.json"), "w") as f:
        json.dump(phases, f, indent=2)


def _worker_phases(model: str, out: str, phases: dict[str, float]) -> None:
    """One worker brought up in this process, each phase under cProfile (this process
    imports torch only here: `LLM()` alone leaves it to the worker processes)."""
    start = time.perf_counter()
    import torch

    phases["import torch"] = time.perf_counter() - start
    print(f"{'import torch':>18}: {phases['import torch']:7.2f} s", flush=True)
    _profiled("import minivllm", lambda: __import__("minivllm.worker.worker"), out, phases)
    from minivllm.config import EngineArgs
    from minivllm.engine_core.scheduler import Scheduler
    from minivllm.worker.worker import Worker

    engine_args = EngineArgs(model=model, load_format="dummy", skip_tokenizer_init=True)
    config = _profiled("config", engine_args.create_engine_config, out, phases)
    worker = _profiled("worker object", lambda: Worker(config, rank=0), out, phases)
    _profiled("init_device", worker.init_device, out, phases)
    _profiled("load_model", worker.load_model, out, phases)
    blocks = _profiled("memory profile", worker.determine_num_blocks, out, phases)
    _profiled("KV + graphs", functools.partial(worker.initialize_kv_cache, blocks), out, phases)
    _profiled("scheduler", lambda: Scheduler(config.scheduler, config.cache, blocks), out, phases)
    worker.shutdown()
    del worker
    torch.cuda.empty_cache()
    phases["num_blocks"] = blocks


if __name__ == "__main__":
    main()
