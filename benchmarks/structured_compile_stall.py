"""Does compiling a new grammar stall the engine's steps? A step-time trace while new JSON
schemas compile under load.

    python benchmarks/qwen3_tokenizer.py --out benchmarks/.qwen3-tokenizer   # once, offline after
    python benchmarks/structured_compile_stall.py --tokenizer benchmarks/.qwen3-tokenizer

Dummy Qwen3-0.6B weights (or --model DIR). 256 requests of 512 prompt tokens decode 256
tokens each, half under a JSON schema compiled during the warm-up, half free; meanwhile,
every 100 ms, one more request arrives with a JSON schema never seen before (fields of its
own), 16 in all, each compiled on the engine-core's thread pool while the steps run. The
engine's step trace (MINIVLLM_STEP_TRACE) gives each step's time (between consecutive
outputs); pure-decode steps launched while a grammar compiled are compared with those
launched while none did. --trace FILE keeps the trace.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time

from minivllm.frontend.bench.structured import SCHEMA


def new_schema(i: int) -> dict:
    """SCHEMA with field names of its own: a grammar no cache has seen."""
    props = {f"{name}_{i}": spec for name, spec in SCHEMA["properties"].items()}
    return {**SCHEMA, "properties": props, "required": list(props)}


def run(args: argparse.Namespace, model: str, load_format: str) -> None:
    from minivllm import EngineArgs, SamplingParams, StructuredOutputsParams
    from minivllm.frontend.llm_engine import LLMEngine

    engine = LLMEngine.from_engine_args(
        EngineArgs(model=model, tokenizer=args.tokenizer, load_format=load_format,
                   max_model_len=args.input_len + args.output_len + 64,
                   enable_prefix_caching=False)
    )  # fmt: skip
    rng = random.Random(0)
    max_id = min(10000, engine.config.model.vocab_size)

    def prompt() -> dict:
        return {"prompt_token_ids": [rng.randrange(max_id) for _ in range(args.input_len)]}

    def params(max_tokens: int, schema: dict | None) -> SamplingParams:
        so = None if schema is None else StructuredOutputsParams(json=schema)
        return SamplingParams(max_tokens=max_tokens, ignore_eos=True, structured_outputs=so)

    def drain() -> None:
        while engine.has_unfinished_requests():
            engine.step()

    for i in range(8):  # warm-up: the compiler, SCHEMA's grammar, the kernels
        engine.add_request(f"warm-{i}", prompt(), params(16, SCHEMA if i % 2 else None))
    drain()
    for i in range(args.num_requests):
        engine.add_request(f"r{i}", prompt(), params(args.output_len, SCHEMA if i % 2 else None))
    start = time.perf_counter()
    added = 0
    while engine.has_unfinished_requests():
        engine.step()
        due = time.perf_counter() - start - 0.5  # decoding by then
        if added < args.num_new_schemas and due >= added * 0.1:
            engine.add_request(f"new-{added}", prompt(), params(16, new_schema(added)))
            added += 1
    engine.shutdown()  # the engine-core writes the trace


def analyze(path: str, num_requests: int) -> None:
    with open(path) as f:
        steps = [s for s in map(json.loads, f) if s["applied_ms"] is not None]
    times: dict[bool, list[float]] = {True: [], False: []}
    rows = []
    for prev, s in zip(steps, steps[1:], strict=False):
        gap = s["applied_ms"] - prev["applied_ms"]
        # the batch's steady decode (not the warm-up, not its tail)
        if s["prefill_tokens"] == 0 and s["num_seqs"] >= 0.75 * num_requests:
            compiling = s.get("grammars_compiling", 0) > 0
            times[compiling].append(gap)
            rows.append((s["launched_ms"], s["num_seqs"], s.get("grammars_compiling", 0), gap))
    quiet, busy = sorted(times[False]), sorted(times[True])
    if not busy or not quiet:
        raise SystemExit("no decode steps overlapped a compile (or none did not): see the trace")

    def pct(xs: list[float], q: float) -> float:
        return xs[min(len(xs) - 1, int(q * len(xs)))]

    base = statistics.median(quiet)
    print(
        f"{'decode steps of the whole batch':<34}{'count':>6}{'median':>9}{'p90':>8}{'p99':>8}{'max':>8}"
    )
    for name, xs in (("no grammar compiling", quiet), ("grammars compiling", busy)):
        print(f"{name:<34}{len(xs):>6}{statistics.median(xs):>9.2f}{pct(xs, 0.9):>8.2f}"
              f"{pct(xs, 0.99):>8.2f}{xs[-1]:>8.2f}")  # fmt: skip
    print(f"compile steps over the quiet median: median {statistics.median(busy) - base:+.2f} ms,"
          f" p99 {pct(busy, 0.99) - base:+.2f} ms, max {busy[-1] - base:+.2f} ms")  # fmt: skip
    first = next(i for i, r in enumerate(rows) if r[2])
    print("\nthe trace around the first compile (launched ms, seqs, compiling, step ms):")
    for r in rows[max(0, first - 4) : first + 12]:
        print(f"  {r[0]:10.1f} {r[1]:5d} {r[2]:3d} {r[3]:8.2f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tokenizer", required=True, help="Qwen3's (benchmarks/qwen3_tokenizer.py)")
    p.add_argument("--model", default=None, help="a checkpoint (default: dummy Qwen3-0.6B)")
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--num-new-schemas", type=int, default=16)
    p.add_argument("--trace", default=None, help="keep the step trace in this file")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        trace = args.trace or os.path.join(tmp, "trace.jsonl")
        os.environ["MINIVLLM_STEP_TRACE"] = trace  # the engine-core inherits it
        if args.model is None:
            from minivllm.frontend.bench.geometry import write_geometry

            run(args, write_geometry("qwen3-0.6b", os.path.join(tmp, "model")), "dummy")
        else:
            run(args, args.model, "auto")
        analyze(trace, args.num_requests)


if __name__ == "__main__":
    main()
