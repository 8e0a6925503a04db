"""The engine-core's host work per structured-output step, piece by piece, at a real
vocabulary: what stands between step N's sampled tokens and step N+1's bitmask reaching the
workers (the workers run N+1's forward meanwhile).

    python benchmarks/probe_grammar_step.py --tokenizer benchmarks/.qwen3-tokenizer [--rows 256]

Rows follow the benchmark's JSON schema (`bench throughput --structured-outputs`), each
matcher walked forward by random allowed tokens, so the rows sit in different states.
Prints the vocabulary tables' and the grammar's build times, then per step: advancing the
matchers by one token each, filling the bitmask, and the bitmask's trip through the wire
encoding and a ZMQ ipc socket into a pinned-size host buffer.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import numpy as np
import zmq

from minivllm.engine_core.structured_output.grammar import GrammarCompiler
from minivllm.engine_core.structured_output.manager import StructuredOutputManager
from minivllm.frontend.bench.structured import SCHEMA
from minivllm.protocol.messages import GrammarBitmask
from minivllm.protocol.serial import CORE_TO_WORKER, MsgDecoder, MsgEncoder
from minivllm.protocol.structured_outputs import StructuredOutputsParams


class _Request:
    def __init__(self, i: int, state) -> None:
        self.request_id = str(i)
        self.structured_output = state


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--vocab-size", type=int, default=151936)
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--steps", type=int, default=50)
    args = p.parse_args()

    t = time.perf_counter()
    compiler = GrammarCompiler(args.tokenizer, args.vocab_size)
    print(f"vocabulary tables: {time.perf_counter() - t:.2f} s")
    spec = StructuredOutputsParams(json=SCHEMA).spec()
    t = time.perf_counter()
    compiled = compiler.compile(spec)
    print(f"8-field schema compiled: {(time.perf_counter() - t) * 1e3:.0f} ms")

    manager = StructuredOutputManager(args.tokenizer, args.vocab_size, args.rows)
    requests = []
    for i in range(args.rows):
        state = manager_state(compiler, compiled, spec)
        requests.append(_Request(i, state))
    rng = np.random.default_rng(0)
    ctx = zmq.Context()
    addr = f"ipc://{tempfile.mkdtemp()}/bitmask"
    push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    push.bind(addr)
    pull.connect(addr)
    encoder, decoder = MsgEncoder(), MsgDecoder(CORE_TO_WORKER)
    staging = np.empty((args.rows, manager.num_words), dtype=np.int32)
    times: dict[str, list[float]] = {"advance": [], "fill": [], "wire": []}
    bitmask = manager.fill_bitmask(requests)
    for step in range(args.steps):
        tokens = [pick(bitmask[i], rng) for i in range(args.rows)]
        t0 = time.perf_counter()
        for r, tok in zip(requests, tokens, strict=True):
            if not r.structured_output.accept([tok]):
                raise RuntimeError("a token the bitmask allowed was refused")
        t1 = time.perf_counter()
        bitmask = manager.fill_bitmask(requests)
        t2 = time.perf_counter()
        push.send_multipart(encoder.encode(GrammarBitmask(step, bitmask)), copy=True)
        msg = decoder.decode([f.buffer for f in pull.recv_multipart(copy=False)])
        staging[...] = msg.bitmask
        t3 = time.perf_counter()
        for name, dt in (("advance", t1 - t0), ("fill", t2 - t1), ("wire", t3 - t2)):
            times[name].append(dt * 1e3)
    done = sum(r.structured_output.terminated for r in requests)
    print(f"{args.rows} rows, {args.steps} steps ({done} grammars ended), ms per step:")
    for name, xs in times.items():
        xs.sort()
        print(
            f"  {name:<8} median {statistics.median(xs):6.2f}   p90 {xs[int(0.9 * len(xs))]:6.2f}"
        )
    manager.shutdown()


def manager_state(compiler: GrammarCompiler, compiled, spec):
    from minivllm.engine_core.structured_output.manager import StructuredOutputRequest

    state = StructuredOutputRequest(spec, [])
    state.matcher = compiler.matcher(compiled, None)
    return state


def pick(row: np.ndarray, rng: np.random.Generator) -> int:
    """A random token the bitmask row allows."""
    allowed = np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))
    return int(rng.choice(allowed))


if __name__ == "__main__":
    main()
