"""IPC overhead: round-trip time of a small message between two processes, and the cost of
encoding + decoding one 256-request step.

    PYTHONPATH=. python benchmarks/ipc_roundtrip.py [--iters 20000] [--transport ipc|tcp]

The child process plays the engine-core: it connects a DEALER to the parent's ROUTER, says
hello with a Heartbeat, then answers each message. "raw" echoes the frames untouched;
"typed" decodes an EngineCoreRequest and answers with an encoded EngineCoreOutputs, as the
real input/output threads do.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time
from collections.abc import Callable

import zmq

from minivllm.protocol.messages import (
    CachedRequestData,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    Heartbeat,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    SchedulerStats,
)
from minivllm.protocol.sampling_params import SamplingParams
from minivllm.protocol.serial import (
    CORE_TO_FRONTEND,
    CORE_TO_WORKER,
    FRONTEND_TO_CORE,
    ID_FRAME_THRESHOLD,
    WORKER_TO_CORE,
    MsgDecoder,
    MsgEncoder,
)
from minivllm.protocol.transport import (
    bind_socket,
    cleanup_ipc,
    close_socket,
    connect_socket,
    ipc_address,
    make_ipc_dir,
    recv_from,
    recv_msg,
    send_msg,
    send_to,
    tcp_address,
)

STOP = b"stop"


def _child(address: str, typed: bool) -> None:
    ctx = zmq.Context()
    sock = connect_socket(ctx, zmq.DEALER, address, identity=b"core")
    encoder, decoder = MsgEncoder(), MsgDecoder(FRONTEND_TO_CORE)
    reply = encoder.encode(EngineCoreOutputs([EngineCoreOutput("r", [42])], timestamp=1.0))
    send_msg(sock, encoder.encode(Heartbeat(os.getpid())))
    while True:
        frames = recv_msg(sock)
        if frames[0] == STOP:
            break
        if typed:
            req = decoder.decode(frames)
            reply = encoder.encode(EngineCoreOutputs([EngineCoreOutput(req.request_id, [42])]))
        send_msg(sock, reply if typed else frames)
    close_socket(sock, linger=0)
    ctx.term()


def round_trips(address: str, iters: int, typed: bool) -> list[float]:
    """Seconds per round trip, measured in the parent."""
    ctx = zmq.Context()
    router, bound = bind_socket(ctx, zmq.ROUTER, address)  # bind before the child starts
    proc = mp.get_context("spawn").Process(target=_child, args=(bound, typed), daemon=True)
    proc.start()
    try:
        hello = recv_from(router, timeout_ms=30_000)
        if hello is None:
            raise RuntimeError(f"child did not connect (exit code {proc.exitcode})")
        peer = hello[0]
        encoder, decoder = MsgEncoder(), MsgDecoder(CORE_TO_FRONTEND)
        req = EngineCoreRequest("req-0", list(range(16)), SamplingParams(max_tokens=8))
        frames = encoder.encode(req)
        times = []
        for i in range(iters + iters // 10):  # the first tenth warms up and is dropped
            t0 = time.perf_counter()
            send_to(router, peer, encoder.encode(req) if typed else frames)
            got = recv_from(router, timeout_ms=10_000)
            if got is None:
                raise RuntimeError(f"child stopped answering (exit code {proc.exitcode})")
            reply = got[1]
            if typed:
                decoder.decode(reply)
            if i >= iters // 10:
                times.append(time.perf_counter() - t0)
        send_to(router, peer, [STOP])
        proc.join(10)
        return times
    finally:
        if proc.is_alive():
            proc.kill()
        close_socket(router, linger=0)
        ctx.term()


def _new_req(i: int, num_tokens: int) -> NewRequestData:
    return NewRequestData(
        f"req-{i}",
        list(range(1000, 1000 + num_tokens)),
        num_tokens,
        SamplingParams(temperature=0.8, top_p=0.95, max_tokens=256),
        list(range(i * 64, i * 64 + num_tokens // 16 + 1)),
        0,
        sample_seed=i,
    )


def step_messages(n: int = 256) -> list[tuple[str, object, tuple[type, ...]]]:
    ids = [f"req-{i}" for i in range(n)]
    decode_step = SchedulerOutput(
        step_id=7,
        scheduled_cached_reqs=CachedRequestData(
            ids, [[i] if i % 16 == 0 else [] for i in range(n)], [500 + i for i in range(n)]
        ),
        num_scheduled_tokens=dict.fromkeys(ids, 1),
        total_num_scheduled_tokens=n,
    )
    prefill_step = SchedulerOutput(
        step_id=1,
        scheduled_new_reqs=[_new_req(i, 512) for i in range(n)],
        num_scheduled_tokens=dict.fromkeys(ids, 512),
        total_num_scheduled_tokens=512 * n,
    )
    outputs = EngineCoreOutputs(
        [EngineCoreOutput(r, [1234]) for r in ids],
        SchedulerStats(num_running=n, kv_cache_usage=0.5, step_counter=7),
        timestamp=time.time(),
    )
    runner = ModelRunnerOutput(7, ids, [[1234] for _ in ids])
    return [
        (f"SchedulerOutput, {n} cached (decode)", decode_step, CORE_TO_WORKER),
        (f"SchedulerOutput, {n} new x 512 tok", prefill_step, CORE_TO_WORKER),
        (f"ModelRunnerOutput, {n} reqs", runner, WORKER_TO_CORE),
        (f"EngineCoreOutputs, {n} outputs", outputs, CORE_TO_FRONTEND),
    ]


def _best_us(fn: Callable[[], object], repeat: int = 5, number: int = 50) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        best = min(best, (time.perf_counter() - t0) / number)
    return best * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iters", type=int, default=20_000)
    parser.add_argument("--transport", choices=("ipc", "tcp"), default="ipc")
    args = parser.parse_args()

    ipc_dir = make_ipc_dir()
    try:
        print(f"round trip over {args.transport}://, {args.iters} iterations")
        print(f"{'mode':<8} {'median µs':>10} {'p99 µs':>10}")
        for typed in (False, True):
            address = ipc_address(ipc_dir, "rtt") if args.transport == "ipc" else tcp_address()
            times = sorted(round_trips(address, args.iters, typed))
            p99 = times[min(len(times) - 1, int(len(times) * 0.99))]
            mode = "typed" if typed else "raw"
            print(f"{mode:<8} {statistics.median(times) * 1e6:>10.1f} {p99 * 1e6:>10.1f}")
    finally:
        cleanup_ipc(ipc_dir)

    print()
    print(f"{'message':<36} {'frames':>6} {'bytes':>8} {'encode µs':>10} {'decode µs':>10}")
    for label, msg, allowed in step_messages():
        for threshold in (None, ID_FRAME_THRESHOLD):
            encoder, decoder = MsgEncoder(aux_threshold=threshold), MsgDecoder(allowed)
            frames = encoder.encode(msg)
            assert decoder.decode(frames) == msg
            nbytes = sum(memoryview(f).nbytes for f in frames)
            enc = _best_us(lambda e=encoder, m=msg: e.encode(m))
            dec = _best_us(lambda d=decoder, f=frames: d.decode(f))
            if threshold is not None and len(frames) == 1:
                continue  # nothing moved out: the row would repeat the inline one
            name = label if threshold is None else f"  same, ids > {threshold} as frames"
            print(f"{name:<36} {len(frames):>6} {nbytes:>8} {enc:>10.1f} {dec:>10.1f}")


if __name__ == "__main__":
    main()
