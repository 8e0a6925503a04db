"""`python benchmarks/grammar.py --tokenizer DIR`: what structured outputs cost the
engine-core, at a real vocabulary (Qwen3's: benchmarks/qwen3_tokenizer.py builds it offline).

1. Host work per step, piece by piece, for --rows requests under the JSON schema of
   `minivllm bench throughput --structured-outputs` (each matcher walked by random allowed
   tokens, so the rows sit in different states): advancing the matchers by one token each,
   filling the bitmask, and the bitmask's trip through the wire encoding and a ZMQ ipc socket
   into a host buffer. This is what stands between step N's tokens and step N+1's bitmask
   reaching the workers, who run N+1's forward meanwhile.
2. Does compiling a new grammar stall the steps? --num-requests requests decode (half under
   that schema, compiled in a warm-up, half free) while, every 100 ms, one more arrives with
   a JSON schema never seen before, compiled on the engine-core's threads meanwhile. From the
   step trace: pure-decode steps of the whole batch launched while a grammar compiled,
   against those launched while none did, and the trace around the first compile.

Part 2 reads the engine's step trace: run with MINIVLLM_STEP_TRACE=FILE. Dummy Qwen3-0.6B
weights unless --model DIR (on the CPU, the qwen3-cpu-tiny geometry).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from typing import Any

import numpy as np

from minivllm import EngineArgs, SamplingParams, StructuredOutputsParams, envs
from minivllm.benchmarks import run_script
from minivllm.benchmarks.common import add_model_args, model_dir
from minivllm.benchmarks.structured import SCHEMA
from minivllm.frontend.llm_engine import LLMEngine


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokenizer", required=True, help="the vocabulary grammars compile against")
    p.add_argument("--model", default=None, help="a checkpoint (default: a geometry, dummy)")
    p.add_argument("--device", default="auto", help="auto: CUDA when there is a GPU")
    p.add_argument("--rows", type=int, default=256, help="part 1: constrained requests")
    p.add_argument("--steps", type=int, default=50, help="part 1: steps timed")
    p.add_argument("--num-requests", type=int, default=256, help="part 2: the decoding batch")
    p.add_argument("--input-len", type=int, default=512, help="part 2: prompt tokens")
    p.add_argument("--output-len", type=int, default=256, help="part 2: output tokens")
    p.add_argument(
        "--num-new-schemas", type=int, default=16, help="part 2: schemas compiled meanwhile"
    )
    add_model_args(p)


def main(args: argparse.Namespace) -> dict[str, Any]:
    with model_dir(args) as (model, geometry):
        with open(os.path.join(model, "config.json")) as f:
            vocab_size = int(json.load(f)["vocab_size"])
        figures = {"step": host_work(args.tokenizer, vocab_size, args.rows, args.steps)}
        trace = envs.step_trace_path()
        if trace is None:
            print("part 2 needs the step trace: run with MINIVLLM_STEP_TRACE=FILE")
            return figures
        decode_under_compiles(args, model, "dummy" if geometry else "auto")
        figures["stall"] = compare_steps(trace, args.num_requests)
    return figures


# ---------------------------------------------------------------- 1. host work per step


def host_work(tokenizer: str, vocab_size: int, rows: int, steps: int) -> dict[str, float]:
    import zmq

    from minivllm.engine_core.structured_output.grammar import GrammarCompiler
    from minivllm.engine_core.structured_output.manager import (
        StructuredOutputManager,
        StructuredOutputRequest,
    )
    from minivllm.protocol.messages import GrammarBitmask
    from minivllm.protocol.serial import CORE_TO_WORKER, MsgDecoder, MsgEncoder

    t = time.perf_counter()
    compiler = GrammarCompiler(tokenizer, vocab_size)
    tables_s = time.perf_counter() - t
    spec = StructuredOutputsParams(json=SCHEMA).spec()
    t = time.perf_counter()
    compiled = compiler.compile(spec)
    compile_s = time.perf_counter() - t
    print(f"vocabulary tables {tables_s:.2f} s; the 8-field schema compiled in {compile_s:.2f} s")

    class Request:  # what fill_bitmask reads of a request
        def __init__(self) -> None:
            self.structured_output = StructuredOutputRequest(spec, [])
            self.structured_output.matcher = compiler.matcher(compiled, None)

    manager = StructuredOutputManager(tokenizer, vocab_size, rows)
    requests = [Request() for _ in range(rows)]
    rng = np.random.default_rng(0)
    ctx = zmq.Context()
    with tempfile.TemporaryDirectory() as tmp:
        push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
        push.bind(f"ipc://{tmp}/bitmask")
        pull.connect(f"ipc://{tmp}/bitmask")
        encoder, decoder = MsgEncoder(), MsgDecoder(CORE_TO_WORKER)
        host = np.empty((rows, manager.num_words), dtype=np.int32)
        times: dict[str, list[float]] = {"advance": [], "fill": [], "wire": []}
        bitmask = manager.fill_bitmask(requests)
        for step in range(steps):
            tokens = [_allowed_token(bitmask[i], rng) for i in range(rows)]
            t0 = time.perf_counter()
            for r, token in zip(requests, tokens, strict=True):
                assert r.structured_output.accept([token]), "a token the bitmask allowed"
            t1 = time.perf_counter()
            bitmask = manager.fill_bitmask(requests)
            t2 = time.perf_counter()
            push.send_multipart(encoder.encode(GrammarBitmask(step, bitmask)), copy=True)
            host[...] = decoder.decode([f.buffer for f in pull.recv_multipart(copy=False)]).bitmask
            t3 = time.perf_counter()
            for name, dt in zip(times, (t1 - t0, t2 - t1, t3 - t2), strict=True):
                times[name].append(dt * 1e3)
        push.close(linger=0)
        pull.close(linger=0)
    ctx.term()
    manager.shutdown()
    ended = sum(r.structured_output.terminated for r in requests)
    print(f"{rows} rows, {steps} steps ({ended} grammars ended), ms per step (median / p90):")
    figures = {"tables_s": tables_s, "compile_s": compile_s}
    for name, xs in times.items():
        xs.sort()
        print(f"  {name:<8}{statistics.median(xs):8.2f}{xs[int(0.9 * (len(xs) - 1))]:8.2f}")
        figures[f"{name}_ms"] = statistics.median(xs)
    return figures


def _allowed_token(row: np.ndarray, rng: np.random.Generator) -> int:
    return int(rng.choice(np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))))


# ---------------------------------------------------------------- 2. steps while compiling


def new_schema(i: int) -> dict:
    """SCHEMA with field names of its own: a grammar no cache has seen."""
    props = {f"{name}_{i}": spec for name, spec in SCHEMA["properties"].items()}
    return {**SCHEMA, "properties": props, "required": list(props)}


def decode_under_compiles(args: argparse.Namespace, model: str, load_format: str) -> None:
    engine = LLMEngine.from_engine_args(
        EngineArgs(
            model=model,
            tokenizer=args.tokenizer,
            load_format=load_format,
            device=args.device,
            max_model_len=args.input_len + args.output_len + 64,
            enable_prefix_caching=False,
        )
    )
    rng = random.Random(0)
    max_id = min(10000, engine.config.model.vocab_size)

    def prompt() -> dict:
        return {"prompt_token_ids": [rng.randrange(max_id) for _ in range(args.input_len)]}

    def params(max_tokens: int, schema: dict | None) -> SamplingParams:
        so = None if schema is None else StructuredOutputsParams(json=schema)
        return SamplingParams(max_tokens=max_tokens, ignore_eos=True, structured_outputs=so)

    try:
        for i in range(8):  # warm-up: the compiler, SCHEMA's grammar, the kernels
            engine.add_request(f"warm-{i}", prompt(), params(16, SCHEMA if i % 2 else None))
        while engine.has_unfinished_requests():
            engine.step()
        for i in range(args.num_requests):
            schema = SCHEMA if i % 2 else None
            engine.add_request(f"r{i}", prompt(), params(args.output_len, schema))
        start = time.perf_counter()
        added = 0
        while engine.has_unfinished_requests():
            engine.step()
            due = time.perf_counter() - start - 0.5  # decoding by then
            if added < args.num_new_schemas and due >= added * 0.1:
                engine.add_request(f"new-{added}", prompt(), params(16, new_schema(added)))
                added += 1
    finally:
        engine.shutdown()  # the engine-core writes the trace


def compare_steps(path: str, num_requests: int) -> dict[str, float]:
    with open(path) as f:
        steps = [s for s in map(json.loads, f) if s["applied_ms"] is not None]
    times: dict[bool, list[float]] = {True: [], False: []}
    rows = []
    for prev, s in zip(steps, steps[1:], strict=False):
        # the batch's steady decode: not the warm-up, the prompts or the tail
        if s["prefill_tokens"] == 0 and s["num_seqs"] >= 0.75 * num_requests:
            gap = s["applied_ms"] - prev["applied_ms"]
            compiling = s.get("grammars_compiling", 0)
            times[compiling > 0].append(gap)
            rows.append((s["launched_ms"], s["num_seqs"], compiling, gap))
    quiet, busy = sorted(times[False]), sorted(times[True])
    if not quiet or not busy:
        print("no decode step of the batch overlapped a compile (or every one did)")
        return {}

    def pct(xs: list[float], q: float) -> float:
        return xs[int(q * (len(xs) - 1))]

    print(f"\n{'decode steps of the batch':<28}{'count':>6}{'median':>8}{'p90':>8}{'p99':>8}"
          f"{'max':>8}  ms")  # fmt: skip
    for name, xs in (("no grammar compiling", quiet), ("grammars compiling", busy)):
        print(f"{name:<28}{len(xs):>6}{statistics.median(xs):>8.2f}{pct(xs, 0.9):>8.2f}"
              f"{pct(xs, 0.99):>8.2f}{xs[-1]:>8.2f}")  # fmt: skip
    base = statistics.median(quiet)
    excess = {"median": statistics.median(busy) - base, "p99": pct(busy, 0.99) - base}
    excess["max"] = busy[-1] - base
    print("steps while compiling, over the others' median: " + ", ".join(
        f"{k} {v:+.2f} ms" for k, v in excess.items()))  # fmt: skip
    first = next(i for i, r in enumerate(rows) if r[2])
    print("the trace around the first compile (launched ms, sequences, compiling, step ms):")
    for r in rows[max(0, first - 4) : first + 12]:
        print(f"  {r[0]:10.1f} {r[1]:5d} {r[2]:3d} {r[3]:8.2f}")
    return {f"excess_{k}_ms": v for k, v in excess.items()} | {"quiet_median_ms": base}


if __name__ == "__main__":
    run_script(__doc__, add_arguments, main)
