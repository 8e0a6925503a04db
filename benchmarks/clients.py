"""`python benchmarks/clients.py`: the engine-core's cost per step against the number of clients
attached to it (API processes, daemon clients), on the CPU with the null model.

One engine-core serves --num-requests streams of --output-len tokens, split evenly over K of
16 attached clients (K = 1, 2, 4, 8, 16; the others stay idle). The clients take the
engine-core's outputs as they come (no detokenization: what is measured is the engine-core).
Per K: the engine-core process's CPU time per step and per client per step, and whether
every output reached only the client whose request it is (an idle client must receive
none). A core that sent every output to every client would cost K times more per output.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from typing import Any

from minivllm.benchmarks import run_script
from minivllm.benchmarks.null_checkpoint import build_null_checkpoint
from minivllm.config import EngineArgs
from minivllm.frontend.clients.mp_client import AsyncMPClient
from minivllm.frontend.input_processor import InputProcessor
from minivllm.protocol.messages import UtilityMethod
from minivllm.protocol.sampling_params import SamplingParams

MAX_CLIENTS = 16


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-requests", type=int, default=256, help="streams in each run")
    p.add_argument("--output-len", type=int, default=256, help="tokens of each")
    p.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4, 8, 16], help="K of each run")
    p.add_argument("--output-json", default=None, help="write the figures to this file")


async def _client_run(
    client: AsyncMPClient, processor: InputProcessor, n: int, output_len: int, tag: str
) -> tuple[int, int]:
    """Send n streams from `client`, take its outputs until they end: (tokens, foreign
    outputs, those of requests it did not send)."""
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    ids = set()
    for i in range(n):
        _, request = processor.process(f"{tag}-{i}", [7, 8, 9, i % 100 + 10], params)
        ids.add(request.request_id)
        await client.add_request_async(request)
    tokens = foreign = 0
    unfinished = set(ids)
    while unfinished:
        batch = await client.get_output_async()
        for out in batch.outputs:
            if out.request_id not in ids:
                foreign += 1
                continue
            tokens += len(out.new_token_ids)
            if out.finish_reason is not None:
                unfinished.discard(out.request_id)
    return tokens, foreign


async def _run(
    clients: list[AsyncMPClient],
    processor: InputProcessor,
    k: int,
    args: argparse.Namespace,
    proc: Any,
) -> dict:
    before_steps = (await clients[0].call_utility_async(UtilityMethod.STATS))["step_counter"]
    cpu = proc.cpu_times()
    start = time.perf_counter()
    per_client = args.num_requests // k
    results = await asyncio.gather(
        *(
            _client_run(c, processor, per_client, args.output_len, f"k{k}-c{i}")
            for i, c in enumerate(clients[:k])
        )
    )
    elapsed = time.perf_counter() - start
    after = proc.cpu_times()
    steps = (await clients[0].call_utility_async(UtilityMethod.STATS))["step_counter"]
    steps -= before_steps
    cpu_s = (after.user + after.system) - (cpu.user + cpu.system)
    idle_outputs = sum(c.outputs.qsize() for c in clients[k:] if c.outputs is not None)
    return {
        "clients": k,
        "tokens": sum(t for t, _ in results),
        "foreign_outputs": sum(f for _, f in results),
        "idle_client_outputs": idle_outputs,
        "elapsed_s": elapsed,
        "steps": steps,
        "core_cpu_us_per_step": 1e6 * cpu_s / max(steps, 1),
        "core_cpu_us_per_step_per_client": 1e6 * cpu_s / max(steps, 1) / k,
        "tokens_per_s": sum(t for t, _ in results) / elapsed,
    }


async def _main(args: argparse.Namespace, model: str) -> list[dict[str, Any]]:
    import psutil

    blocks = 2 * args.num_requests * -(-(16 + args.output_len) // 16)
    config = EngineArgs(model=model, num_gpu_blocks_override=blocks).create_engine_config()
    owner = AsyncMPClient(config)  # spawns the engine-core
    clients = [owner]
    try:
        clients += [AsyncMPClient.connect(owner.address) for _ in range(MAX_CLIENTS - 1)]
        for c in clients:
            c._ensure_started()  # every client reads (and heartbeats) from here on
        proc = psutil.Process(owner.proc.pid)
        processor = InputProcessor(config.model, None)
        warm = argparse.Namespace(num_requests=8, output_len=16)
        await _run(clients, processor, 1, warm, proc)
        runs = []
        for k in args.clients:
            run = await _run(clients, processor, k, args, proc)
            runs.append(run)
            print(
                f"{k:2d} clients: {run['tokens']:,} tokens in {run['elapsed_s']:.2f} s, "
                f"{run['steps']} steps; engine-core CPU {run['core_cpu_us_per_step']:.0f} µs "
                f"per step, {run['core_cpu_us_per_step_per_client']:.0f} µs per step per "
                f"client; outputs to the wrong client: {run['foreign_outputs']}, to idle "
                f"clients: {run['idle_client_outputs']}"
            )
        return runs
    finally:
        for c in reversed(clients):
            c.shutdown()


def main(args: argparse.Namespace) -> dict:
    import uvloop

    if any(not 1 <= k <= MAX_CLIENTS for k in args.clients):
        raise SystemExit(f"benchmarks/clients.py: --clients must be between 1 and {MAX_CLIENTS}")
    with tempfile.TemporaryDirectory(prefix="minivllm-null-") as tmp:
        model = build_null_checkpoint(tmp)
        print(
            f"Null model; {args.num_requests} streams x {args.output_len} tokens per run, "
            f"split over K of {MAX_CLIENTS} attached clients"
        )
        runs = uvloop.run(_main(args, model))
    wrong = sum(r["foreign_outputs"] + r["idle_client_outputs"] for r in runs)
    if wrong:
        raise SystemExit(f"benchmarks/clients.py: {wrong} outputs went to a client not their own")
    return {"runs": runs}


if __name__ == "__main__":
    run_script(__doc__, add_arguments, main)
