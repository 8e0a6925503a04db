"""The main function of a worker process: receive steps, run them, rank 0 answers.

Startup: connect; init the device (and the TP group: rank 0 hosts the rendezvous store on a
port the OS picked when it bound, and the engine-core relays it to the other ranks); load
the model; report how many KV blocks fit; wait for the agreed number; allocate; report ready.
Steps are launched on the main thread and answered from a sender thread, which waits for
each step's sampled ids, so the main thread is already launching the next step meanwhile.
A step is two calls, `execute_model` and `sample_tokens`: a step with structured outputs
samples when its `GrammarBitmask` comes (the next message, which the engine-core fills while
the forward runs); any other step samples at once.
Any exception is sent back as an error and ends the process: a TP peer that keeps running
would block forever in its next collective, so the engine-core tears all ranks down.
"""

from __future__ import annotations

import datetime
import faulthandler
import logging
import os
import queue
import signal
import sys
import threading
import traceback
from multiprocessing.connection import Connection

import zmq

from minivllm import envs
from minivllm.config import EngineConfig
from minivllm.logging_utils import configure_process_logging
from minivllm.process_utils import die_with_parent, freeze_startup_heap
from minivllm.protocol import transport
from minivllm.protocol.messages import (
    GrammarBitmask,
    InitKVCache,
    ModelRunnerOutput,
    Rendezvous,
    SchedulerOutput,
    ShutdownWorker,
    WorkerLoaded,
    WorkerReady,
)
from minivllm.protocol.serial import CORE_TO_WORKER, MsgDecoder, MsgEncoder
from minivllm.worker.async_output import AsyncModelRunnerOutput
from minivllm.worker.step_profiler import StepProfiler

logger = logging.getLogger(__name__)


def run_worker(
    config: EngineConfig,
    rank: int,
    step_address: str,
    result_address: str,
    ready_pipe: Connection,
    death_pipe: Connection,
) -> None:
    die_with_parent(death_pipe)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the engine-core decides when we stop
    # a step that hangs: the engine-core asks for the stacks before it kills us
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    configure_process_logging()
    ready_pipe.close()
    serve(config, rank, step_address, result_address)


def serve(
    config: EngineConfig,
    rank: int,
    step_address: str,
    result_address: str,
    store_host: str = "127.0.0.1",
) -> None:
    """The worker loop, in whatever process hosts it (a spawned child, a Ray actor); returns
    after a `ShutdownWorker`, ends the process after a failure. Rank 0 hosts the TP
    rendezvous store on `store_host`, an address the other ranks reach."""
    # the main thread and the sender thread hand the GIL back and forth every step
    sys.setswitchinterval(0.0005)
    ctx = zmq.Context()
    steps = transport.connect_socket(ctx, zmq.PULL, step_address)
    # `results` has a context of its own, so a failing worker can wait for its error to
    # leave before it exits (`transport.close_and_flush`)
    results = transport.connect_socket(zmq.Context(), zmq.PUSH, result_address)
    decoder = MsgDecoder(CORE_TO_WORKER, max_ids=config.model.max_model_len)
    spin_s = envs.spin_wait_s(config.device.device)  # awake between steps, on CUDA
    # only the sender thread touches `results` (ZMQ sockets are not thread-safe)
    outbox: queue.Queue = queue.Queue()
    sender = threading.Thread(
        target=_send_loop, args=(rank, results, outbox), name="worker-sender", daemon=True
    )
    sender.start()

    send = outbox.put

    def send_output(out: AsyncModelRunnerOutput | None) -> None:
        if out is not None:  # rank 0 answers
            send(out)

    def recv():
        while True:
            frames = transport.recv_msg(steps, spin_s=spin_s)
            msg = transport.decode_or_drop(decoder, frames, "its step socket", f"worker {rank} ")
            if msg is not None:
                return msg

    step_id = -1
    try:
        store = None
        if config.parallel.tensor_parallel_size > 1:
            store = _rendezvous(rank, send, recv, store_host)
        from minivllm.worker.worker import Worker

        worker = Worker(config, rank=rank, dist_store=store)
        worker.init_device()
        worker.load_model()
        send(WorkerLoaded(rank, os.getpid(), worker.determine_num_blocks()))
        profiler = StepProfiler(rank)
        while True:
            msg = recv()
            if isinstance(msg, SchedulerOutput):
                step_id = msg.step_id
                profiler.step()
                # launch and move on: the sender thread waits for the output, so the next
                # step is received and queued on the GPU behind this one
                worker.execute_model(msg)
                if not msg.structured_output_req_ids:
                    send_output(worker.sample_tokens())
            elif isinstance(msg, GrammarBitmask):
                send_output(worker.sample_tokens(msg))
            elif isinstance(msg, InitKVCache):
                worker.initialize_kv_cache(msg.num_blocks)
                freeze_startup_heap()
                send(WorkerReady(rank, os.getpid(), worker.startup_s))
            elif isinstance(msg, ShutdownWorker):
                break
    except Exception:
        send(ModelRunnerOutput(step_id=step_id, error=_log_failure(rank)))
        outbox.put(None)
        sender.join(timeout=10.0)
        _flush_and_exit(results)
    outbox.put(None)
    sender.join(timeout=10.0)
    results.close(linger=0)
    steps.close(linger=0)
    results.context.term()
    ctx.term()


def _send_loop(rank: int, results: zmq.Socket, outbox: queue.Queue) -> None:
    """Send what the main thread queues, in order; a step's output once its sampled ids
    have reached the host. None ends the loop."""
    encoder = MsgEncoder()
    what = f"worker rank {rank}'s results"
    while (item := outbox.get()) is not None:
        try:
            msg = item.get() if isinstance(item, AsyncModelRunnerOutput) else item
            frames = encoder.encode(msg)
            transport.check_size(frames, what)
        except Exception:
            error = ModelRunnerOutput(getattr(item, "step_id", -1), error=_log_failure(rank))
            transport.send_msg(results, encoder.encode(error))
            _flush_and_exit(results)
        transport.send_msg(results, frames)


def _rendezvous(rank: int, send, recv, host: str):
    """TP rendezvous with no probe-then-bind race: rank 0 binds port 0 and shares the result."""
    import torch.distributed as dist

    if rank == 0:
        store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
        send(Rendezvous(host, store.port))
        return store
    msg = recv()
    if not isinstance(msg, Rendezvous):
        raise RuntimeError(f"worker {rank}: expected the rendezvous address, got {msg!r}")
    return dist.TCPStore(
        msg.host, msg.port, is_master=False, timeout=datetime.timedelta(seconds=60)
    )


def _log_failure(rank: int) -> str:
    """Log the exception being handled; returns the text the engine-core is sent."""
    error = f"worker rank {rank} (pid {os.getpid()}) failed:\n{traceback.format_exc()}"
    logger.error(error)
    return error


def _flush_and_exit(results: zmq.Socket) -> None:
    """End the process once the error sent on `results` has left: the engine-core then
    reports the cause, not just an exit code."""
    transport.close_and_flush(results)
    os._exit(1)
