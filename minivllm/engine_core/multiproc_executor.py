"""Workers in their own processes, driven over ZMQ: each step is broadcast to every rank
and rank 0 answers. Tensors between ranks go over torch.distributed, never through here."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from typing import Any

import zmq

from minivllm import envs
from minivllm.config import EngineConfig
from minivllm.engine_core.executor import Executor
from minivllm.exceptions import EngineDeadError, EngineStartupError
from minivllm.process_utils import describe_exit, private_ipc_dir, spawn, terminate
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
from minivllm.protocol.serial import WORKER_TO_CORE, MsgDecoder, MsgEncoder

logger = logging.getLogger(__name__)

_POLL_MS = 100


class StepFuture:
    """Rank 0's answer to one step, received when asked for."""

    def __init__(self, executor: MultiprocExecutor, step_id: int) -> None:
        self.executor = executor
        self.step_id = step_id
        self.sent_at = time.monotonic()

    def result(self) -> ModelRunnerOutput:
        ex = self.executor
        # a step queued behind another starts its clock when that one's result is in
        timeout = ex.execute_timeout if ex.num_results else None
        while True:
            out = ex._poll_output(self.step_id, timeout_ms=_POLL_MS)
            if out is not None:
                ex.num_results += 1
                ex.last_result_at = time.monotonic()
                return out
            if timeout is not None and time.monotonic() - timeout > max(
                self.sent_at, ex.last_result_at
            ):
                ex.fail_hung_step(self.step_id, f"sent no result for step {self.step_id}")


class MultiprocExecutor(Executor):
    """Workers as child processes of the engine-core, steps over ipc sockets. Subclasses
    place the workers elsewhere (`RayExecutor`) through the three `_*_workers` hooks and
    `_address`; the start-up talk, the steps and the dead-rank handling stay the same."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        tp = config.parallel.tensor_parallel_size
        # inherited by the workers, read when their torch loads OpenMP: idle threads must not
        # spin-wait, or on a small CPU machine they starve the frontend and the engine-core
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
        if config.parallel.visible_devices is not None:  # this data-parallel rank's GPUs
            os.environ["CUDA_VISIBLE_DEVICES"] = config.parallel.visible_devices
        self.ipc_dir = private_ipc_dir("workers")
        self.spin_s = envs.spin_wait_s(config.device.device)  # waiting for a worker's output
        self.ctx = zmq.Context()
        self.encoder, self.decoder = MsgEncoder(), MsgDecoder(WORKER_TO_CORE)
        self.results, result_addr = transport.bind_socket(
            self.ctx, zmq.PULL, self._address("results")
        )
        self.step_socks = []
        self.procs = []
        self.death_pipes = []
        self._outputs: dict[int, ModelRunnerOutput] = {}
        self._unsampled_step: int | None = None  # launched by execute_model, not yet sampled
        self._dead: str | None = None
        self.execute_timeout = config.parallel.execute_timeout
        self.num_results = 0  # the first step (compiling, capturing) has no time limit
        self.last_result_at = 0.0
        try:
            step_addrs = []
            for rank in range(tp):
                sock, addr = transport.bind_socket(
                    self.ctx, zmq.PUSH, self._address(f"steps-{rank}")
                )
                # with no worker connected a send would block for good: see _broadcast
                sock.setsockopt(zmq.SNDTIMEO, _POLL_MS)
                self.step_socks.append(sock)
                step_addrs.append(addr)
            start = time.perf_counter()
            self._start_workers(step_addrs, result_addr)
            self.num_blocks = self._startup(start)
        except BaseException:
            self.shutdown()
            raise

    def _address(self, name: str) -> str:
        return transport.ipc_address(self.ipc_dir, name)

    def _start_workers(self, step_addrs: list[str], result_addr: str) -> None:
        for rank, addr in enumerate(step_addrs):
            proc, ready, death = spawn(
                "minivllm.worker.worker_process:run_worker",
                dict(config=self.config, rank=rank, step_address=addr, result_address=result_addr),
                name=f"worker-rank{rank}",
            )
            ready.close()
            self.procs.append(proc)
            self.death_pipes.append(death)

    def _dead_worker(self) -> str | None:
        """How the first dead worker ended, or None while all live."""
        for p in self.procs:
            if not p.is_alive():
                return describe_exit(p)
        return None

    def _stop_workers(self, graceful: bool) -> None:
        """End every worker: after a `ShutdownWorker` (graceful) they get 2 s to leave."""
        if graceful:
            deadline = time.monotonic() + 2.0
            for p in self.procs:
                p.join(max(0.0, deadline - time.monotonic()))
        terminate([p for p in self.procs if p.is_alive()], timeout=5.0)
        for pipe in self.death_pipes:
            pipe.close()

    # ------------------------------------------------------------------ startup

    def _startup(self, start: float) -> int:
        tp = self.config.parallel.tensor_parallel_size
        self._startup_timeout_s = envs.startup_timeout_s()
        deadline = time.monotonic() + self._startup_timeout_s
        blocks: dict[int, int] = {}
        while len(blocks) < tp:
            msg = self._recv_startup(deadline)
            if isinstance(msg, Rendezvous):  # rank 0's store, for the other ranks
                self._broadcast(msg, first_rank=1)
            elif isinstance(msg, WorkerLoaded):
                blocks[msg.rank] = msg.num_gpu_blocks
        loaded_s = time.perf_counter() - start
        num_blocks = min(blocks.values())
        self._broadcast(InitKVCache(num_blocks))
        ready: dict[int, WorkerReady] = {}
        while len(ready) < tp:
            msg = self._recv_startup(deadline)
            if isinstance(msg, WorkerReady):
                ready[msg.rank] = msg
        phases = ready[0].startup_s
        # what the worker did not time itself: spawning it, its imports, the TP rendezvous
        before_load = loaded_s - sum(phases.get(p, 0.0) for p in ("device", "load", "profile"))
        self.startup_s = {"processes": max(0.0, before_load), **phases}
        logger.info("%d worker process(es) ready", tp)
        return num_blocks

    def _recv_startup(self, deadline: float) -> Rendezvous | WorkerLoaded | WorkerReady:
        while time.monotonic() < deadline:
            msg = self._recv(_POLL_MS)
            if msg is None and (dead := self._dead_worker()):
                raise EngineStartupError(f"{dead} during startup")
            if isinstance(msg, ModelRunnerOutput) and msg.error:
                raise EngineStartupError(msg.error)
            if isinstance(msg, (Rendezvous, WorkerLoaded, WorkerReady)):
                return msg
        raise EngineStartupError(f"workers did not start within {self._startup_timeout_s:.0f} s")

    # ------------------------------------------------------------------ steps

    def _broadcast(self, msg, first_rank: int = 0) -> None:
        """Send `msg` to every rank from `first_rank` on; `EngineDeadError` once a rank died
        (a dead worker is noticed when waiting for its answer times out, every 100 ms)."""
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        frames = self.encoder.encode(msg)
        transport.check_size(frames, f"{type(msg).__name__} for the workers")
        deadline = None
        for rank in range(first_rank, len(self.step_socks)):
            sock = self.step_socks[rank]
            while True:
                try:
                    transport.send_msg(sock, frames, copy=True)
                    break
                except zmq.Again:  # this worker is not connected: it died, or was cut off
                    self.check_health()
                    deadline = deadline or time.monotonic() + (self.execute_timeout or 1e9)
                    if time.monotonic() > deadline:
                        self.fail_hung_step(None, f"did not take {type(msg).__name__}", rank)

    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        self._broadcast(scheduler_output)
        self._unsampled_step = scheduler_output.step_id

    def sample_tokens(self, grammar_bitmask: GrammarBitmask | None) -> StepFuture:
        step_id, self._unsampled_step = self._unsampled_step, None
        assert step_id is not None, "sample_tokens without a step"
        if grammar_bitmask is not None:  # else the workers sample the step without waiting
            assert grammar_bitmask.step_id == step_id, "a bitmask for another step"
            self._broadcast(grammar_bitmask)  # copied into ZMQ: the core may refill its buffer
        return StepFuture(self, step_id)

    def _poll_output(self, step_id: int, timeout_ms: int) -> ModelRunnerOutput | None:
        if step_id in self._outputs:
            return self._outputs.pop(step_id)
        msg = self._recv(timeout_ms)
        if not isinstance(msg, ModelRunnerOutput):
            self.check_health()
            return None
        if msg.error:
            self._dead = msg.error
            raise EngineDeadError(msg.error)
        if msg.step_id == step_id:
            return msg
        self._outputs[msg.step_id] = msg
        return None

    def _recv(self, timeout_ms: int) -> Any:
        """The next message from a worker; None if none came within `timeout_ms` (or what
        came did not decode)."""
        frames = transport.recv_msg(self.results, timeout_ms=timeout_ms, spin_s=self.spin_s)
        if frames is None:
            return None
        return transport.decode_or_drop(self.decoder, frames, "the results socket")

    def fail_hung_step(self, step_id: int | None, what: str, rank: int = 0) -> None:
        """A worker has not answered within execute_timeout: log every worker's stacks, stop
        them all and raise EngineDeadError naming the rank."""
        pid = f" (pid {self.procs[rank].pid})" if self.procs else ""
        self._dead = (
            f"worker rank {rank}{pid} {what} within execute_timeout "
            f"({self.execute_timeout:g} s); the engine stopped and its workers were killed"
        )
        if len(self.step_socks) > 1:
            self._dead += " (with tensor parallelism the stuck rank may be another one)"
        logger.error("%s; the workers' Python stacks follow", self._dead)
        for p in self.procs:
            with contextlib.suppress(OSError):
                os.kill(p.pid, signal.SIGUSR1)  # faulthandler in the worker prints its stacks
        time.sleep(0.5)
        self._stop_workers(graceful=False)
        raise EngineDeadError(self._dead)

    def check_health(self) -> None:
        if self._dead is None:
            dead = self._dead_worker()
            if dead:
                self._dead = self._last_words(dead)
        if self._dead is not None:
            raise EngineDeadError(self._dead)

    def _last_words(self, exit_status: str) -> str:
        """A worker that fails sends its traceback before it exits; the exit can still be
        seen first. Wait briefly for that message: the cause beats an exit code."""
        deadline = time.monotonic() + 0.5
        while time.monotonic() < deadline:
            msg = self._recv(50)
            if isinstance(msg, ModelRunnerOutput):
                if msg.error:
                    return f"{msg.error.rstrip()}\n({exit_status})"
                self._outputs[msg.step_id] = msg
        return exit_status

    def shutdown(self) -> None:
        if getattr(self, "_shut", False):
            return
        self._shut = True
        # workers still starting may not even listen yet: a shutdown message would wait
        graceful = self._dead is None and hasattr(self, "num_blocks")
        if graceful:
            with contextlib.suppress(zmq.ZMQError, EngineDeadError):
                self._broadcast(ShutdownWorker())
        self._stop_workers(graceful)
        for sock in [*self.step_socks, self.results]:
            sock.close(linger=0)
        self.ctx.term()
        transport.cleanup_ipc(self.ipc_dir)
