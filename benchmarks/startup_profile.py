"""Where start-up time goes: each phase of bringing up one worker in this process (imports,
device, weights, memory profile, KV cache and CUDA graphs), each under cProfile, then the
whole `LLM(...)` start to ready as a user sees it.

    python benchmarks/startup_profile.py [--geometry qwen3-0.6b] [--out DIR]

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

T0 = time.perf_counter()
import torch  # noqa: E402

T_TORCH = time.perf_counter() - T0


def _profiled(name: str, fn, out: str, phases: dict[str, float]):
    prof = cProfile.Profile()
    start = time.perf_counter()
    prof.enable()
    result = fn()
    prof.disable()
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
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    phases: dict[str, float] = {"import torch": T_TORCH}
    print(f"{'import torch':>18}: {T_TORCH:7.2f} s", flush=True)
    _profiled("import minivllm", lambda: __import__("minivllm.worker.worker"), args.out, phases)
    from minivllm.benchmarks.geometry import write_geometry
    from minivllm.config import EngineArgs
    from minivllm.worker.worker import Worker

    with tempfile.TemporaryDirectory() as tmp:
        model = write_geometry(args.geometry, tmp)
        engine_args = EngineArgs(model=model, load_format="dummy", skip_tokenizer_init=True)
        config = _profiled("config", engine_args.create_engine_config, args.out, phases)
        worker = _profiled("worker object", lambda: Worker(config, rank=0), args.out, phases)
        _profiled("init_device", worker.init_device, args.out, phases)
        _profiled("load_model", worker.load_model, args.out, phases)
        blocks = _profiled("memory profile", worker.determine_num_blocks, args.out, phases)
        kv_cache = functools.partial(
            worker.initialize_kv_cache, blocks
        )  # `worker` is deleted below
        _profiled("KV + graphs", kv_cache, args.out, phases)
        from minivllm.engine_core.scheduler import Scheduler

        _profiled(
            "scheduler",
            lambda: Scheduler(config.scheduler, config.cache, blocks),
            args.out,
            phases,
        )
        worker.shutdown()
        worker = None
        torch.cuda.empty_cache()
        phases["num_blocks"] = blocks

        from minivllm import LLM

        start = time.perf_counter()
        llm = LLM(model=model, load_format="dummy", skip_tokenizer_init=True)
        phases["LLM() to ready"] = time.perf_counter() - start
        print(f"{'LLM() to ready':>18}: {phases['LLM() to ready']:7.2f} s", flush=True)
        llm.shutdown()
    with open(os.path.join(args.out, "phases.json"), "w") as f:
        json.dump(phases, f, indent=2)


if __name__ == "__main__":
    main()
