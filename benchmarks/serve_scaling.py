"""Serving at scale on the CPU with the null model (a GPU host's GPUs are left alone): `minivllm serve -dp M --api-server-count N`
loaded by `bench serve` at one concurrency, one server after another on the same workload.

    python benchmarks/serve_scaling.py          # a 16-core host: DP=1/1 API, 2/2, 4/4 at 1024
    python benchmarks/serve_scaling.py --configs 1x1,1x2 --max-concurrency 256 \\
        --num-prompts 512 --output-len 128 --client-processes 1    # a quick look on 2 cores

The load comes from --client-processes processes started together (one asyncio client binds
well below what four API processes stream), each with its share of the concurrency and of
the prompts; the throughput is all their output tokens over the span from the first start to
the last end. Per config (MxN: DP=M with N API processes): output tok/s, its ratio to the
first config (targets: 2x2 >= 1.8x and 4x4 >= 3.2x of 1x1), mean TTFT and TPOT, and the CPU
time per output token of each kind of process (API, engine-core, worker, client) and each
process's cores kept busy (CPU seconds over the span). Figures go
to $OUT/serve_scaling.json when $OUT is set, else to --output-json if given; the servers'
logs go to $OUT too.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import multiprocessing
import os
import platform
import sys
import tempfile
import time

import psutil

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGETS = {"2x2": 1.8, "4x4": 3.2}  # output tok/s against 1x1


def _client(argv: list[str], barrier, results) -> None:
    """One client process: prepare, wait for the others, run, report."""
    sys.path.insert(0, _REPO)
    from minivllm.benchmarks import serve as bench_serve

    cpu = [0.0]

    def start() -> None:
        barrier.wait()
        cpu[0] = time.process_time()

    with contextlib.redirect_stdout(io.StringIO()):  # one table per client is noise
        result = bench_serve.run_together(argv, start)
    results.put({**result, "client_cpu_s": time.process_time() - cpu[0]})


def _roles(serve_pid: int, api_servers: int) -> dict[str, list[psutil.Process]]:
    """The server's processes by kind: the API process is the serve process itself when it
    is alone; an engine-core is a child with children (its workers)."""
    serve = psutil.Process(serve_pid)
    roles: dict[str, list[psutil.Process]] = {"api": [], "engine-core": [], "worker": []}
    roles["api" if api_servers == 1 else "serve"] = [serve]
    for child in serve.children():
        if "resource_tracker" in " ".join(child.cmdline()):
            continue
        workers = child.children()
        if workers:
            roles["engine-core"].append(child)
            roles["worker"] += workers
        else:
            roles["api"].append(child)
    return roles


def _cpu_s(proc: psutil.Process) -> float:
    """Its CPU seconds so far (0 once it has ended)."""
    with contextlib.suppress(psutil.Error):
        t = proc.cpu_times()
        return t.user + t.system
    return 0.0


def _load(url: str, model: str, args: argparse.Namespace) -> list[dict]:
    """Run the clients together; each one's result."""
    ctx = multiprocessing.get_context("spawn")
    n = args.client_processes
    barrier, results = ctx.Barrier(n), ctx.Queue()
    procs = []
    for i in range(n):
        argv = ["--base-url", url, "--tokenizer", model, "--ignore-eos", "--temperature", "0"]
        argv += ["--num-prompts", str(args.num_prompts // n), "--seed", str(i)]
        argv += ["--max-concurrency", str(args.max_concurrency // n)]
        argv += ["--random-input-len", str(args.input_len)]
        argv += ["--random-output-len", str(args.output_len)]
        procs.append(ctx.Process(target=_client, args=(argv, barrier, results)))
        procs[-1].start()
    try:
        return [results.get(timeout=600) for _ in procs]
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()


def run_config(config: str, model: str, args: argparse.Namespace, log_dir: str) -> dict:
    from minivllm.benchmarks import serve as bench_serve
    from minivllm.benchmarks.null_checkpoint import null_model_env
    from minivllm.frontend.server.launch import ServerProcess

    dp, api = (int(x) for x in config.split("x"))
    blocks = 2 * args.max_concurrency * -(-(args.input_len + args.output_len) // 16)
    server_args = [model, "--device", "cpu", "-dp", str(dp), "--api-server-count", str(api)]
    server_args += ["--max-num-seqs", str(args.max_concurrency)]
    server_args += ["--num-gpu-blocks-override", str(blocks), "--disable-uvicorn-access-log"]
    server_args += ["--stream-interval", str(args.stream_interval)]
    # the server is a process on its own: the null model is its plugin
    env = null_model_env(os.environ)
    env["CUDA_VISIBLE_DEVICES"] = ""  # the null model on the host's cores, a GPU or not
    log = os.path.join(log_dir, f"server-{config}.log")
    started = time.perf_counter()
    with ServerProcess(server_args, log, env, startup_timeout=300) as server:
        ready_s = time.perf_counter() - started
        roles = _roles(server.proc.pid, api)
        assert len(roles["engine-core"]) == dp and len(roles["api"]) == api, roles
        warm = ["--base-url", server.url, "--tokenizer", model, "--num-prompts", "64"]
        with contextlib.redirect_stdout(io.StringIO()):
            bench_serve.run([*warm, "--random-input-len", "32", "--random-output-len", "16"])
        before = {role: [_cpu_s(p) for p in procs] for role, procs in roles.items()}
        clients = _load(server.url, model, args)
        after = {role: [_cpu_s(p) for p in procs] for role, procs in roles.items()}
    tokens = sum(c["total_output_tokens"] for c in clients)
    span = max(c["end_time"] for c in clients) - min(c["start_time"] for c in clients)
    each = {role: [a - b for a, b in zip(after[role], before[role], strict=True)] for role in roles}
    cpu = {role: sum(s) for role, s in each.items()}
    cpu["client"] = sum(c["client_cpu_s"] for c in clients)
    return {
        "config": config,
        "data_parallel_size": dp,
        "api_server_count": api,
        "startup_s": ready_s,
        "completed": sum(c["completed"] for c in clients),
        "failed": sum(c["failed"] for c in clients),
        "output_tokens": tokens,
        "duration_s": span,
        "output_throughput": tokens / span,
        "client_throughputs": [c["output_throughput"] for c in clients],
        "mean_ttft_ms": sum(c["mean_ttft_ms"] for c in clients) / len(clients),
        "mean_tpot_ms": sum(c["mean_tpot_ms"] for c in clients) / len(clients),
        "cpu_us_per_token": {role: 1e6 * s / tokens for role, s in cpu.items()},
        # each process's CPU seconds over the span: 1.0 is one core kept busy
        "busy": {role: [round(s / span, 2) for s in each[role]] for role in roles if each[role]},
    }


def _report(run: dict, base: dict) -> None:
    ratio = run["output_throughput"] / base["output_throughput"]
    target = TARGETS.get(run["config"]) if base["config"] == "1x1" else None
    verdict = (
        ""
        if target is None
        else f" (target >= {target}x: {'met' if ratio >= target else 'MISSED'})"
    )
    cpu = ", ".join(f"{k} {v:.1f}" for k, v in run["cpu_us_per_token"].items())
    print(
        f"DP={run['data_parallel_size']} with {run['api_server_count']} API: "
        f"{run['output_tokens']:,} tokens in {run['duration_s']:.2f} s = "
        f"{run['output_throughput']:,.0f} output tok/s, {ratio:.2f}x{verdict}; "
        f"failed {run['failed']}; TTFT {run['mean_ttft_ms']:.0f} ms, TPOT "
        f"{run['mean_tpot_ms']:.2f} ms; CPU µs per token: {cpu}; started in "
        f"{run['startup_s']:.1f} s; cores busy per process: {run['busy']}",
        flush=True,
    )


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--configs", default="1x1,2x2,4x4", help="DPxAPI, comma-separated")
    p.add_argument("--max-concurrency", type=int, default=1024)
    p.add_argument("--num-prompts", type=int, default=6144)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--client-processes", type=int, default=8)
    p.add_argument(
        "--stream-interval", type=int, default=1, help="the servers' (tokens per streamed chunk)"
    )
    p.add_argument("--output-json", default=None)
    args = p.parse_args()
    sys.path.insert(0, _REPO)
    from minivllm.benchmarks.null_checkpoint import build_null_checkpoint

    out_dir = os.environ.get("OUT")
    machine = {
        "cpus": os.cpu_count(),
        "processor": platform.processor() or platform.machine(),
        "load_average": os.getloadavg(),
    }
    print(f"{machine}; {vars(args)}", flush=True)
    runs: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="minivllm-scaling-") as tmp:
        model = build_null_checkpoint(os.path.join(tmp, "null"))
        for config in args.configs.split(","):
            runs.append(run_config(config, model, args, out_dir or tmp))
            _report(runs[-1], runs[0])
    figures = {"machine": machine, "args": vars(args), "runs": runs}
    path = os.path.join(out_dir, "serve_scaling.json") if out_dir else args.output_json
    if path:
        with open(path, "w") as f:
            json.dump(figures, f, indent=2)
        print(f"figures written to {path}")
    return 1 if any(r["failed"] for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
