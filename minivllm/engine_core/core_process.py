"""The engine-core process: a busy loop around `EngineCore`, with socket I/O on threads.

    input thread   ROUTER recv → decode → input queue   (+ client handshakes, heartbeats)
    busy loop      input queue → add/abort/utility; schedule → execute → update → outputs
    output thread  outputs queue → encode → ROUTER send to the owning client (+ heartbeats)

The busy loop never touches a socket, so it never waits on the network. It blocks on the
input queue only when it has no work.
"""

from __future__ import annotations

import gc
import logging
import os
import queue
import signal
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import zmq

from minivllm import envs
from minivllm.config import EngineConfig
from minivllm.engine_core.engine_core import EngineCore
from minivllm.process_utils import die_with_parent
from minivllm.protocol import transport
from minivllm.protocol.messages import (
    PROTOCOL_VERSION,
    Abort,
    ClientHello,
    EngineCoreInfo,
    EngineCoreOutputs,
    EngineCoreRequest,
    Heartbeat,
    RouteReady,
    UtilityCall,
    UtilityMethod,
    UtilityResult,
)
from minivllm.protocol.serial import FRONTEND_TO_CORE, MsgDecoder, MsgEncoder

logger = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 0.5  # core → clients, so a client notices a dead daemon quickly
_ALL = -1  # output-queue address: every attached client
_CLIENT_GONE = "client-gone"
_STOP = object()


def client_identity(client_id: int) -> bytes:
    return client_id.to_bytes(4, "little")


class EngineCoreProc:
    def __init__(self, config: EngineConfig, input_address: str, output_address: str) -> None:
        self.config = config
        self.ctx = zmq.Context()
        # bound before the (slow) engine start, so clients can connect and queue right away
        self.input_sock, self.input_address = transport.bind_socket(
            self.ctx, zmq.ROUTER, input_address
        )
        self.output_sock, self.output_address = transport.bind_socket(
            self.ctx, zmq.ROUTER, output_address
        )
        self.engine_core = EngineCore(config)
        self.input_queue: queue.Queue[tuple[int, Any]] = queue.Queue()
        self.output_queue: queue.Queue[Any] = queue.Queue()
        self.stop_reason: str | None = None
        self._stopping = threading.Event()
        self.threads = [
            threading.Thread(target=self._input_loop, name="core-input", daemon=True),
            threading.Thread(target=self._output_loop, name="core-output", daemon=True),
        ]

    # ------------------------------------------------------------------ busy loop

    def run(self) -> int:
        for t in self.threads:
            t.start()
        gc.collect()
        gc.freeze()  # the start-up heap never needs scanning again: shorter GC pauses
        # a socket call releases the GIL; with the default 5 ms switch interval the busy loop
        # can then wait that long for an I/O thread to hand it back
        sys.setswitchinterval(0.0005)
        core = self.engine_core
        exit_code = 0
        try:
            while self.stop_reason is None:
                self._drain_input(block=not core.has_work())
                if core.has_work():
                    for client, outputs in core.step().items():
                        self.output_queue.put((client, outputs))
        except Exception as e:
            exit_code = 1
            self.stop_reason = f"engine-core (pid {os.getpid()}) died: {e}"
            logger.error("%s\n%s", self.stop_reason, traceback.format_exc())
        self._shutdown()
        return exit_code

    def _drain_input(self, block: bool) -> None:
        try:
            item = self.input_queue.get(timeout=0.2) if block else self.input_queue.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(*item)
            try:
                item = self.input_queue.get_nowait()
            except queue.Empty:
                return

    def _handle(self, client_id: int, msg: Any) -> None:
        core = self.engine_core
        if isinstance(msg, EngineCoreRequest):
            msg.client_id = client_id
            core.add_request(msg)
        elif isinstance(msg, Abort):
            core.abort_requests(msg.request_ids, client_id=client_id)
        elif isinstance(msg, UtilityCall):
            self.output_queue.put((client_id, EngineCoreOutputs(utility_result=self._call(msg))))
        elif msg == _CLIENT_GONE:
            aborted = core.abort_client(client_id)
            logger.info("client %d is gone; aborted its %d request(s)", client_id, len(aborted))

    def _call(self, call: UtilityCall) -> UtilityResult:
        try:
            if call.method == UtilityMethod.SHUTDOWN:
                self.stop_reason = "engine-core shut down by a client"
                result: Any = True
            else:
                result = self.engine_core.call_utility(call.method)
        except Exception as e:
            return UtilityResult(call.call_id, error=f"{type(e).__name__}: {e}")
        return UtilityResult(call.call_id, result=result)

    def request_stop(self, reason: str) -> None:
        """Called from signal handlers: only sets a flag."""
        self.stop_reason = reason

    def _shutdown(self) -> None:
        # clients waiting on anything learn that nothing more will come
        self.output_queue.put((_ALL, EngineCoreOutputs(engine_dead=self.stop_reason)))
        self.output_queue.put(_STOP)
        self.threads[1].join(timeout=5.0)
        self._stopping.set()
        self.threads[0].join(timeout=2.0)
        try:
            self.engine_core.shutdown()
        finally:
            transport.close_socket(self.input_sock, linger=0)
            # the bounded linger lets the death notice above reach the clients
            transport.close_socket(self.output_sock)
            self.ctx.term()

    # ------------------------------------------------------------------ I/O threads

    @staticmethod
    def _decode_from_client(
        decoder: MsgDecoder, identity: bytes, frames: list, where: str
    ) -> tuple[int | None, Any] | None:
        """(client id or None for a malformed identity, message); None if undecodable."""
        try:
            msg = decoder.decode(frames)
        except ValueError as e:
            logger.warning("dropped an undecodable message on the %s socket: %s", where, e)
            return None
        client = int.from_bytes(identity, "little") if len(identity) == 4 else None
        return client, msg

    def _input_loop(self) -> None:
        decoder, encoder = MsgDecoder(FRONTEND_TO_CORE), MsgEncoder()
        last_seen: dict[int, float] = {}
        client_timeout_s = envs.client_timeout_s()  # silent this long: the client is gone
        next_check = time.monotonic() + 1.0
        while not self._stopping.is_set():
            got = transport.recv_from(self.input_sock, timeout_ms=100)
            now = time.monotonic()
            if got is not None:
                decoded = self._decode_from_client(decoder, *got, where="input")
                if decoded is None:
                    continue
                client, msg = decoded
                if client is None:
                    logger.warning("dropped a message from a peer with a malformed identity")
                    continue
                last_seen[client] = now
                if isinstance(msg, ClientHello):
                    reply = self.info(client, msg)
                    transport.send_to(self.input_sock, got[0], encoder.encode(reply))
                elif not isinstance(msg, Heartbeat):  # a heartbeat only refreshes last_seen
                    self.input_queue.put((client, msg))
            if now >= next_check:
                next_check = now + 0.5
                for client, seen in list(last_seen.items()):
                    if now - seen > client_timeout_s:
                        del last_seen[client]
                        self.input_queue.put((client, _CLIENT_GONE))
                        self.output_queue.put((client, _CLIENT_GONE))

    def info(self, client: int = 0, hello: ClientHello | None = None) -> EngineCoreInfo:
        m = self.config.model
        reply = EngineCoreInfo(
            client_id=client,
            model=m.model,
            tokenizer=m.tokenizer,
            max_model_len=m.max_model_len,
            input_address=self.input_address,
            output_address=self.output_address,
        )
        if hello is not None and hello.protocol_version != PROTOCOL_VERSION:
            reply.error = (
                f"protocol version mismatch: client speaks {hello.protocol_version}, "
                f"engine-core speaks {PROTOCOL_VERSION}"
            )
        return reply

    def _output_loop(self) -> None:
        encoder, decoder = MsgEncoder(), MsgDecoder(FRONTEND_TO_CORE)
        routable: set[int] = set()
        pending: dict[int, list[Any]] = {}
        heartbeat = encoder.encode(Heartbeat())
        next_beat = time.monotonic() + HEARTBEAT_INTERVAL_S

        def send(client: int, frames: list) -> None:
            try:
                transport.send_to(self.output_sock, client_identity(client), frames)
            except zmq.ZMQError:
                routable.discard(client)  # the peer is gone

        while True:
            while self.output_sock.poll(0):  # a client registering its output route
                decoded = self._decode_from_client(
                    decoder, *transport.recv_from(self.output_sock), where="output"
                )
                if decoded is None:
                    continue
                client, msg = decoded
                if client is not None and isinstance(msg, ClientHello):
                    routable.add(client)
                    send(client, encoder.encode(RouteReady(client)))
                    for frames_ in pending.pop(client, []):
                        send(client, frames_)
            try:
                item = self.output_queue.get(timeout=0.05)
            except queue.Empty:
                item = None
            if item is _STOP:
                return
            if item is not None:
                client, msg = item
                if msg == _CLIENT_GONE:
                    routable.discard(client)
                    pending.pop(client, None)
                elif client == _ALL:
                    frames = encoder.encode(msg)
                    for c in list(routable):
                        send(c, frames)
                elif client in routable:
                    send(client, encoder.encode(msg))
                else:
                    pending.setdefault(client, []).append(encoder.encode(msg))
            now = time.monotonic()
            if now >= next_beat:
                next_beat = now + HEARTBEAT_INTERVAL_S
                for c in list(routable):
                    send(c, heartbeat)


def run_engine_core(
    config: EngineConfig,
    input_address: str,
    output_address: str,
    ready_pipe: Connection | None = None,
    death_pipe: Connection | None = None,
    daemon: bool = False,
) -> None:
    """Process entry point. A spawned engine-core dies with its frontend; a daemon does not."""
    if not daemon:
        die_with_parent(death_pipe)
    logging.basicConfig(
        level=envs.log_level(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    proc: EngineCoreProc | None = None

    def on_signal(signum: int, _frame: Any) -> None:
        if proc is not None:
            proc.request_stop(f"engine-core stopped by {signal.Signals(signum).name}")
        else:
            raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        proc = EngineCoreProc(config, input_address, output_address)
    except BaseException as e:
        cause = "".join(traceback.format_exception_only(type(e), e)).strip()
        error = f"engine-core (pid {os.getpid()}) failed to start: {cause}"
        logger.error("%s\n%s", error, traceback.format_exc())
        if ready_pipe is not None:
            ready_pipe.send_bytes(msgspec.msgpack.encode(EngineCoreInfo(error=error)))
        raise SystemExit(1) from None
    if ready_pipe is not None:
        ready_pipe.send_bytes(msgspec.msgpack.encode(proc.info()))
        ready_pipe.close()
    logger.info(
        "engine-core listening on %s (outputs on %s)", proc.input_address, proc.output_address
    )
    raise SystemExit(proc.run())
