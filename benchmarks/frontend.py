"""`python benchmarks/frontend.py`: an API process's CPU per output token with no engine behind it.

Synthetic engine-core outputs (one new token for every running stream per batch, as decode
steps send them; the null checkpoint's BPE vocabulary, so every token is detokenized) go
through what `/v1/completions` runs for a stream: `AsyncLLM`'s output handling (output
processing, detokenization, stats, the per-request queues), the completions stream view,
SSE framing and the event-stream response, up to the bytes handed to the HTTP server. Left
out: HTTP parsing and the socket write of each chunk (`benchmarks/serve_null_cpu.py`
measures the whole server, those included). --profile prints where the time goes.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import pstats
import random
import tempfile
import time
from typing import Any

from minivllm.benchmarks import run_script
from minivllm.benchmarks.null_checkpoint import build_null_checkpoint
from minivllm.config import EngineArgs
from minivllm.frontend.async_llm import AsyncLLM
from minivllm.frontend.metrics.prometheus import PrometheusStatLogger
from minivllm.process_utils import freeze_startup_heap
from minivllm.protocol.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    FinishReason,
    SchedulerStats,
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-requests", type=int, default=256, help="streams at once")
    p.add_argument("--output-len", type=int, default=256, help="tokens of each")
    p.add_argument(
        "--steps-per-wakeup",
        type=int,
        default=1,
        help="decode steps the streams find waiting when they run (1: the server keeps up "
        "with the engine; more: it lags, and each stream writes several tokens at once)",
    )
    p.add_argument("--runs", type=int, default=3, help="timed runs (the best is reported)")
    p.add_argument("--profile", action="store_true", help="cProfile one more run")
    p.add_argument("--output-json", default=None, help="write the figures to this file")


class _ReplayClient:
    """Stands in for the engine-core client: each `get_output_async` is one decode step,
    a token for every running request; every `steps_per_wakeup` steps the streams take
    what has come."""

    def __init__(self, vocab_size: int, steps_per_wakeup: int) -> None:
        self.steps_per_wakeup = steps_per_wakeup
        self.steps = 0
        self.remaining: dict[str, int] = {}
        self.rng = random.Random(0)
        self.vocab_size = vocab_size
        self.stats = SchedulerStats(0, 0, 0.0)

    async def add_requests_async(self, requests: list[Any]) -> None:
        for r in requests:
            self.remaining[r.request_id] = r.sampling_params.max_tokens

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        for r in request_ids:
            self.remaining.pop(r, None)

    async def get_output_async(self) -> EngineCoreOutputs:
        while not self.remaining:
            await asyncio.sleep(0.001)
        self.steps += 1
        if self.steps % self.steps_per_wakeup == 0:
            await asyncio.sleep(0)  # the streams take what came before the next step
        outputs = []
        draw = self.rng.randrange
        for request_id, left in list(self.remaining.items()):
            out = EngineCoreOutput(request_id, [draw(1, self.vocab_size)])
            if left == 1:
                out.finish_reason = FinishReason.LENGTH
                del self.remaining[request_id]
            else:
                self.remaining[request_id] = left - 1
            outputs.append(out)
        return EngineCoreOutputs(outputs=outputs, scheduler_stats=self.stats, timestamp=time.time())

    async def call_utility_async(self, method: Any) -> Any:
        return True

    def shutdown(self) -> None:
        pass


async def _stream(state: Any, index: int, output_len: int, sink: list[int]) -> None:
    """One /v1/completions stream, as the route answers it, into `sink` (bytes sent)."""
    from minivllm.frontend.server.completions import _CompletionView
    from minivllm.frontend.server.protocol import CompletionRequest, StreamOptions
    from minivllm.frontend.server.sampling import completion_sampling_params
    from minivllm.frontend.server.streaming import EventStreamResponse

    ids = [7, 8, 9, index % 1000 + 10]
    request = CompletionRequest(
        prompt=ids,
        max_tokens=output_len,
        stream=True,
        stream_options=StreamOptions(include_usage=True),
        ignore_eos=True,
    )
    params = completion_sampling_params(request, True, state.sampling_defaults)
    request_id = f"cmpl-{index}"
    streams = [state.engine.generate({"prompt_token_ids": ids}, params, f"{request_id}-0")]
    view = _CompletionView(state, request, [(None, ids)], request_id, state.model_name)
    response = EventStreamResponse(streams, view)

    async def receive() -> dict:
        await asyncio.Event().wait()  # the client never leaves
        return {}

    async def send(message: dict) -> None:
        sink[0] += len(message.get("body", b""))

    await response({"type": "http"}, receive, send)


async def _run(state: Any, args: argparse.Namespace) -> tuple[float, float, int]:
    """(wall s, CPU s, bytes) of one run of every stream."""
    sink = [0]
    wall, cpu = time.perf_counter(), time.process_time()
    await asyncio.gather(
        *(_stream(state, i, args.output_len, sink) for i in range(args.num_requests))
    )
    return time.perf_counter() - wall, time.process_time() - cpu, sink[0]


async def _main(model: str, args: argparse.Namespace) -> dict:
    from minivllm.frontend.server.app import ServerState

    config = EngineArgs(model=model).create_engine_config().model
    metrics = PrometheusStatLogger("null", config.max_model_len)
    client = _ReplayClient(config.vocab_size, args.steps_per_wakeup)
    engine = AsyncLLM(config, client, [metrics])  # type: ignore[arg-type]
    state = ServerState(engine, ["null"], metrics=metrics)
    freeze_startup_heap()  # as the server does
    tokens = args.num_requests * args.output_len
    await _run(state, argparse.Namespace(num_requests=8, output_len=16))  # warm-up
    runs = []
    for _ in range(args.runs):
        wall, cpu, nbytes = await _run(state, args)
        runs.append({"wall_s": wall, "cpu_s": cpu, "bytes": nbytes})
        print(
            f"{tokens:,} tokens in {wall:.2f} s ({cpu:.2f} s CPU): "
            f"{1e6 * cpu / tokens:.2f} µs CPU per token, {nbytes / tokens:.0f} bytes per token"
        )
    if args.profile:
        profiler = cProfile.Profile()
        profiler.enable()
        await _run(state, args)
        profiler.disable()
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(25)
        print(out.getvalue())
    best = min(r["cpu_s"] for r in runs)
    print(f"Best: {1e6 * best / tokens:.2f} µs CPU per output token (without the socket write)")
    return {"tokens": tokens, "runs": runs, "best_cpu_us_per_token": 1e6 * best / tokens}


def main(args: argparse.Namespace) -> dict:
    import uvloop

    with tempfile.TemporaryDirectory(prefix="minivllm-null-") as tmp:
        model = build_null_checkpoint(tmp)
        print(
            f"{args.num_requests} streams x {args.output_len} tokens through the API "
            f"process's stream path (no engine, no socket), {args.steps_per_wakeup} decode "
            "step(s) per wake-up of the streams"
        )
        return uvloop.run(_main(model, args))


if __name__ == "__main__":
    run_script(__doc__, add_arguments, main)
