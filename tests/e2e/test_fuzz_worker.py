"""Garbage on a live worker's step socket, between the steps of canary requests: each frame
is dropped with a log line naming the peer and the reason, nothing is executed, and every
canary gets exactly its tokens. A 100 MB frame is refused without the worker growing by it.

The test plays the engine-core: it binds the worker's sockets and drives the real scheduler.
"""

from __future__ import annotations

import os
import re
import time

import psutil
import pytest
import zmq
from hypothesis import assume, given

from minivllm import EngineArgs
from minivllm.engine_core.request import Request
from minivllm.engine_core.scheduler import Scheduler
from minivllm.process_utils import private_ipc_dir, spawn, terminate
from minivllm.protocol import transport
from minivllm.protocol.messages import InitKVCache, ModelRunnerOutput, WorkerLoaded, WorkerReady
from minivllm.protocol.serial import CORE_TO_WORKER, WORKER_TO_CORE, MsgDecoder, MsgEncoder
from minivllm.worker.worker_process import run_worker
from tests.e2e.daemon import greedy, null_tokens
from tests.protocol.frame_strategies import LIVE_SETTINGS, garbage, refuses
from tests.tiny_models import build_null_checkpoint

MAX_MODEL_LEN = 512


class FakeCore:
    """The engine-core's side of one worker: the real scheduler, steps out, results in."""

    def __init__(self, model_dir: str) -> None:
        self.config = EngineArgs(
            model=model_dir, max_model_len=MAX_MODEL_LEN
        ).create_engine_config()
        self.ipc_dir = private_ipc_dir("fuzz")
        self.ctx = zmq.Context()
        self.steps, steps_addr = transport.bind_socket(
            self.ctx, zmq.PUSH, transport.ipc_address(self.ipc_dir, "steps")
        )
        self.results, results_addr = transport.bind_socket(
            self.ctx, zmq.PULL, transport.ipc_address(self.ipc_dir, "results")
        )
        self.encoder, self.decoder = MsgEncoder(), MsgDecoder(WORKER_TO_CORE)
        self.proc, ready, self.death = spawn(
            run_worker,
            dict(config=self.config, rank=0, step_address=steps_addr, result_address=results_addr),
            name="worker-rank0",
        )
        ready.close()
        num_blocks = self.recv(WorkerLoaded).num_gpu_blocks
        transport.send_msg(self.steps, self.encoder.encode(InitKVCache(num_blocks)))
        self.recv(WorkerReady)
        self.scheduler = Scheduler(self.config.scheduler, self.config.cache, num_blocks)
        self.tokens: dict[str, list[int]] = {}
        self.prompt_lens: dict[str, int] = {}
        self.finished: list[str] = []

    def recv(self, kind: type):
        frames = transport.recv_msg(self.results, timeout_ms=60_000)
        assert frames is not None, f"no {kind.__name__} from the worker in 60 s"
        msg = self.decoder.decode(frames)
        assert isinstance(msg, kind), msg
        return msg

    def add(self, request_id: str, prompt_len: int, max_tokens: int) -> None:
        prompt = list(range(1, prompt_len + 1))
        self.scheduler.add_request(Request(request_id, prompt, greedy(max_tokens)))
        self.tokens[request_id], self.prompt_lens[request_id] = [], prompt_len

    def step(self) -> None:
        """One step; a request that finishes must have exactly the null model's tokens."""
        so = self.scheduler.schedule()
        transport.send_msg(self.steps, self.encoder.encode(so))
        out = self.recv(ModelRunnerOutput)
        assert out.step_id == so.step_id and out.error is None
        for outputs in self.scheduler.update_from_output(so, out).values():
            for o in outputs:
                self.tokens[o.request_id] += o.new_token_ids
                if o.finish_reason is not None:
                    got = self.tokens.pop(o.request_id)
                    prompt_len = self.prompt_lens.pop(o.request_id)
                    assert got == null_tokens(prompt_len, len(got)) and len(got) == 20
                    self.finished.append(o.request_id)

    def close(self) -> None:
        terminate([self.proc], timeout=5)
        self.death.close()
        for sock in (self.steps, self.results):
            sock.close(linger=0)
        self.ctx.term()
        transport.cleanup_ipc(self.ipc_dir)


@pytest.fixture(scope="module")
def null_dir(tmp_path_factory) -> str:
    return build_null_checkpoint(str(tmp_path_factory.mktemp("null")))


def test_garbage_between_steps_is_dropped_and_logged(null_dir: str, tmp_path, capfd) -> None:
    marker = str(tmp_path / "executed")
    decoder = MsgDecoder(CORE_TO_WORKER, max_ids=MAX_MODEL_LEN)
    core = FakeCore(null_dir)  # spawned here: its log goes to this test's captured stderr
    sent = 0
    next_id = iter(range(1_000_000))

    @LIVE_SETTINGS
    @given(frames=garbage(marker, max_ids=MAX_MODEL_LEN))
    def send(frames: list[bytes]) -> None:
        nonlocal sent
        assume(refuses(decoder, frames))  # the core's own messages are obeyed
        core.steps.send_multipart(frames)
        sent += 1
        if not core.scheduler.has_unfinished_requests():
            core.add(f"canary-{next(next_id)}", prompt_len=sent % 40 + 1, max_tokens=20)
        core.step()

    try:
        send()
        while core.scheduler.has_unfinished_requests():
            core.step()
        # a frame over the socket's limit is refused by ZMQ from its size header, which
        # closes that connection for good (an engine-core that sent it would hear nothing
        # more: its execute_timeout ends the engine)
        rss = psutil.Process(core.proc.pid).memory_info().rss
        core.steps.send(bytes(100 << 20), copy=False)
        time.sleep(3.0)
        grown = psutil.Process(core.proc.pid).memory_info().rss - rss
        assert core.proc.is_alive()
    finally:
        core.close()
    log = capfd.readouterr().err
    pattern = (
        rf"worker 0 dropped a message on its step socket from pid {os.getpid()} \(uid \d+\): \S"
    )
    assert sent > 100
    assert len(re.findall(pattern, log)) == sent, log[-3000:]
    assert len(core.finished) >= sent // 20
    assert grown < 20 << 20, f"the worker grew by {grown >> 20} MiB"
    assert not os.path.exists(marker), "a pickle was executed"
