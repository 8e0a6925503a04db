"""Garbage on every socket of a live engine-core: each frame is dropped with a log line that
names the peer and the reason, nothing is executed, nothing crashes, and a canary request
streaming meanwhile gets exactly its tokens."""

from __future__ import annotations

import os
import re
import threading
import time

import pytest
import zmq
from hypothesis import assume, given

from minivllm import LLM
from minivllm.protocol.limits import MAX_CONTROL_BYTES, MAX_MESSAGE_BYTES, request_frame_bytes
from minivllm.protocol.messages import ClientHello
from minivllm.protocol.serial import FRONTEND_TO_CORE, WORKER_TO_CORE, MsgDecoder
from tests.e2e.daemon import Daemon, greedy, null_tokens
from tests.protocol.frame_strategies import LIVE_SETTINGS, garbage, refuses

MAX_MODEL_LEN = 4096  # the null model's


class Canary(threading.Thread):
    """Requests one after another through its own client, each checked token for token."""

    def __init__(self, address: str) -> None:
        super().__init__(name="canary", daemon=True)
        self.llm = LLM.connect(address)
        self.stop = threading.Event()
        self.done = 0
        self.wrong: list = []

    def run(self) -> None:
        prompt_len = 5
        while not self.stop.is_set():
            prompt = list(range(1, prompt_len + 1))
            out = self.llm.generate([prompt], greedy(100), use_tqdm=False)
            got = list(out[0].outputs[0].token_ids)
            if got != null_tokens(prompt_len, 100):
                self.wrong.append(got)
            self.done += 1
            prompt_len = prompt_len % 50 + 1

    def finish(self) -> None:
        self.stop.set()
        self.join(60)
        self.llm.shutdown()


SOCKETS = {
    # socket: (its address, the peer's socket type, what it decodes, its frame limit)
    "input": (
        lambda d: d.address,
        zmq.DEALER,
        MsgDecoder(FRONTEND_TO_CORE, MAX_MODEL_LEN),
        request_frame_bytes(MAX_MODEL_LEN),
    ),
    "output": (
        lambda d: d.address + ".out",
        zmq.DEALER,
        MsgDecoder([ClientHello]),
        MAX_CONTROL_BYTES,
    ),
    "results": (
        lambda d: d.results_socket(),
        zmq.PUSH,
        MsgDecoder(WORKER_TO_CORE),
        MAX_MESSAGE_BYTES,
    ),
}


@pytest.mark.parametrize("where", SOCKETS)
def test_garbage_is_dropped_and_logged(null_daemon: Daemon, tmp_path, where: str) -> None:
    daemon = null_daemon
    address, kind, decoder, frame_limit = SOCKETS[where]
    marker = str(tmp_path / "executed")
    ctx = zmq.Context()
    sock = ctx.socket(kind)
    sock.connect(address(daemon))
    canary = Canary(daemon.address)
    canary.start()
    sent = 0

    @LIVE_SETTINGS
    @given(frames=garbage(marker, max_ids=MAX_MODEL_LEN))
    def send(frames: list[bytes]) -> None:
        nonlocal sent
        # only what the socket drops: a valid message would be served (or obeyed); a frame
        # over the socket's limit is refused by ZMQ itself (test_bounded_frames.py)
        assume(max(map(len, frames)) <= frame_limit and refuses(decoder, frames))
        sock.send_multipart(frames)
        sent += 1
        assert daemon.proc.poll() is None, "the engine-core died"

    try:
        done_before = canary.done
        send()
        # every frame dropped, each with its line naming this process as the sender
        pattern = re.compile(
            rf"dropped a message on the {where} socket from .*pid {os.getpid()} \(uid \d+\): \S"
        )
        deadline = time.monotonic() + 60
        while len(pattern.findall(daemon.log())) < sent and time.monotonic() < deadline:
            time.sleep(0.5)
        logged = len(pattern.findall(daemon.log()))
        time.sleep(1.0)  # let the canary run past the last frame
    finally:
        canary.finish()
        sock.close(linger=0)
        ctx.term()
    assert sent > 100
    assert logged == sent
    assert canary.wrong == [] and canary.done > done_before
    assert not os.path.exists(marker), "a pickle was executed"
    assert daemon.proc.poll() is None
    daemon.canary()
