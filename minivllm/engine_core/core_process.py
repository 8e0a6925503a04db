"""The engine-core process: a busy loop around `EngineCore`, with socket I/O on threads.

    input thread   ROUTER recv → decode → input queue   (+ client handshakes, heartbeats)
    busy loop      input queue → add/abort/utility; schedule → execute → update → outputs
    output thread  outputs queue (a step's, one item) → encode → ROUTER send to each owning
                   client (+ heartbeats): output_sender.py

The busy loop never touches a socket, so it never waits on the network. It blocks on the
input queue only when it has no work.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import zmq

from minivllm import envs
from minivllm.config import EngineConfig
from minivllm.engine_core.engine_core import EngineCore
from minivllm.engine_core.output_sender import ALL, STOP, OutputSender
from minivllm.logging_utils import configure_process_logging
from minivllm.process_utils import die_with_parent, freeze_startup_heap
from minivllm.protocol import auth, transport
from minivllm.protocol.auth import CurveServerKeys
from minivllm.protocol.limits import MAX_CONTROL_BYTES, request_frame_bytes
from minivllm.protocol.messages import (
    PROTOCOL_VERSION,
    Abort,
    ClientHello,
    EngineCoreInfo,
    EngineCoreOutputs,
    EngineCoreRequest,
    Heartbeat,
    TokenizerFile,
    UtilityCall,
    UtilityMethod,
    UtilityResult,
)
from minivllm.protocol.serial import FRONTEND_TO_CORE, MsgDecoder, MsgEncoder

logger = logging.getLogger(__name__)

_CLIENT_GONE = "client-gone"


class EngineCoreProc:
    def __init__(
        self,
        config: EngineConfig,
        input_address: str,
        output_address: str,
        curve: CurveServerKeys | None = None,
        tokenizer_files: list[TokenizerFile] | None = None,
    ) -> None:
        """`tokenizer_files`: what a daemon hands clients that have no tokenizer of their own."""
        self.config = config
        self.tokenizer_files = tokenizer_files
        self.model_config_bytes = msgspec.msgpack.encode(config.model)
        for address in (input_address, output_address):
            auth.check_listen_address(address, curve)
        self.ctx = zmq.Context()
        self.authenticator = auth.start_authenticator(self.ctx, curve) if curve else None
        # bound before the (slow) engine start, so clients can connect and queue right away
        self.input_sock, self.input_address = transport.bind_socket(
            self.ctx,
            zmq.ROUTER,
            input_address,
            max_message_bytes=request_frame_bytes(config.model.max_model_len),
            curve=curve,
        )
        self.output_sock, self.output_address = transport.bind_socket(
            self.ctx, zmq.ROUTER, output_address, max_message_bytes=MAX_CONTROL_BYTES, curve=curve
        )
        try:
            self.engine_core = EngineCore(config)
        except BaseException:
            self._close_sockets(linger_ms=0)
            raise
        self.input_queue: queue.Queue[tuple[int, Any]] = queue.Queue()
        self.output_queue: queue.Queue[Any] = queue.Queue()
        self.stop_reason: str | None = None
        self._stopping = threading.Event()
        self.threads = [
            threading.Thread(target=self._input_loop, name="core-input", daemon=True),
            threading.Thread(target=self._output_loop, name="core-output", daemon=True),
        ]

    def _output_loop(self) -> None:
        OutputSender(self.output_sock, self._decode_from_client).run(self.output_queue)

    # ------------------------------------------------------------------ busy loop

    def run(self) -> int:
        for t in self.threads:
            t.start()
        freeze_startup_heap()
        # a socket call releases the GIL; with the default 5 ms switch interval the busy loop
        # can then wait that long for an I/O thread to hand it back
        sys.setswitchinterval(0.0005)
        core = self.engine_core
        exit_code = 0
        try:
            while self.stop_reason is None:
                self._drain_input(block=not core.has_work())
                if core.has_work() and (outputs := core.step()):
                    self.output_queue.put(outputs)  # the step's, for every client at once
        except Exception as e:
            exit_code = 1
            self.stop_reason = f"engine-core (pid {os.getpid()}) died: {e}"
            logger.error("%s\n%s", self.stop_reason, traceback.format_exc())
        self._shutdown()
        return exit_code

    def _drain_input(self, block: bool) -> None:
        try:
            item = self.input_queue.get(timeout=0.2) if block else self.input_queue.get_nowait()
            while True:
                self._handle(*item)
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
            aborted = core.abort_requests(list(core.scheduler.requests), client_id)
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

    def _shutdown(self) -> None:
        # clients waiting on anything learn that nothing more will come
        self.output_queue.put((ALL, EngineCoreOutputs(engine_dead=self.stop_reason)))
        self.output_queue.put(STOP)
        self.threads[1].join(timeout=5.0)
        self._stopping.set()
        self.threads[0].join(timeout=2.0)
        try:
            self.engine_core.shutdown()
        finally:
            # the bounded linger lets the death notice above reach the clients
            self._close_sockets(linger_ms=None)

    def _close_sockets(self, linger_ms: int | None) -> None:
        """Close both sockets (the output one with `linger_ms`; None: its own bounded one)
        and the context."""
        self.input_sock.close(linger=0)
        self.output_sock.close(linger=linger_ms)
        if self.authenticator is not None:
            self.authenticator.stop()
        self.ctx.term()

    # ------------------------------------------------------------------ I/O threads

    @staticmethod
    def _decode_from_client(
        decoder: MsgDecoder, identity: bytes, frames: list, where: str
    ) -> tuple[int, Any] | None:
        """(client id, message); None, after a log line naming the peer and the reason,
        for anything that is not a message from a client."""
        if len(identity) != 4:
            peer = transport.peer_of(frames[0])
            reason = "the sender did not name itself as a client"
            logger.warning("dropped a message on the %s socket from %s: %s", where, peer, reason)
            return None
        client = f"client {identity.hex()}: "
        msg = transport.decode_or_drop(decoder, frames, f"the {where} socket", client)
        return None if msg is None else (int.from_bytes(identity, "little"), msg)

    def _input_loop(self) -> None:
        decoder = MsgDecoder(FRONTEND_TO_CORE, max_ids=self.config.model.max_model_len)
        encoder = MsgEncoder()
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
                if isinstance(msg, ClientHello):
                    # a client's silence counts from its first message after the hello: an
                    # asyncio client starts its heartbeat with its event loop, which an
                    # application may start long after attaching (its imports, say)
                    if client in last_seen:
                        last_seen[client] = now
                    reply = self.info(client, msg)
                    transport.send_to(self.input_sock, got[0], encoder.encode(reply))
                    continue
                last_seen[client] = now
                if not isinstance(msg, Heartbeat):  # a heartbeat only refreshes last_seen
                    self.input_queue.put((client, msg))
            if now >= next_check:
                next_check = now + 0.5
                for client, seen in list(last_seen.items()):
                    if now - seen > client_timeout_s:
                        del last_seen[client]
                        self.input_queue.put((client, _CLIENT_GONE))
                        why = (
                            f"it sent nothing for {now - seen:.1f} s, over the engine-core's "
                            f"client timeout of {client_timeout_s:g} s (a client sends a "
                            "heartbeat every second: was its event loop blocked?); "
                            "its requests were aborted"
                        )
                        self.output_queue.put((client, EngineCoreOutputs(client_dropped=why)))

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
        reply.model_config = self.model_config_bytes
        if hello is not None and not hello.has_tokenizer:
            reply.tokenizer_files = self.tokenizer_files
        return reply


def run_engine_core(
    config: EngineConfig,
    input_address: str,
    output_address: str,
    ready_pipe: Connection | None = None,
    death_pipe: Connection | None = None,
    daemon: bool = False,
    curve: CurveServerKeys | None = None,
    tokenizer_files: list[TokenizerFile] | None = None,
    run_dir: str | None = None,
) -> None:
    """Process entry point. A spawned engine-core stops on SIGTERM, which its frontend sends
    (or the kernel, when the frontend dies), and ignores SIGINT: its frontend decides what a
    Ctrl-C means. A daemon stops on either. `run_dir`: a directory to remove at exit (the
    spawner's, holding the sockets: a spawner killed by SIGKILL cannot remove it). With
    `curve`, only clients holding authorized keys get through (see protocol/auth.py);
    `tokenizer_files` go to clients that ask (a daemon's)."""
    if not daemon:
        die_with_parent(death_pipe, signal.SIGTERM)
    configure_process_logging()

    def make() -> EngineCoreProc:
        return EngineCoreProc(config, input_address, output_address, curve, tokenizer_files)

    try:
        code = _serve(make, ready_pipe, daemon)
    finally:
        if run_dir is not None:
            transport.cleanup_ipc(run_dir)
    raise SystemExit(code)


def _serve(make: Callable[[], EngineCoreProc], ready_pipe: Connection | None, daemon: bool) -> int:
    """Start the engine-core (`make`) and run it until it stops; the process's exit code."""
    proc: EngineCoreProc | None = None
    stopped_by: list[int] = []
    # a daemon's operator wants to hear why it stopped; a spawned one's frontend asked for it
    stop_level = logging.INFO if daemon else logging.DEBUG

    def on_signal(signum: int, _frame: Any) -> None:
        stopped_by.append(signum)
        if proc is not None:
            proc.stop_reason = f"engine-core stopped by {signal.Signals(signum).name}"
        elif len(stopped_by) == 1:  # only the first one interrupts the start-up
            raise _Interrupted(signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal if daemon else signal.SIG_IGN)
    try:
        proc = make()
    except BaseException as e:
        if stopped_by:
            error = f"engine-core stopped by {signal.Signals(stopped_by[0]).name} while starting"
            logger.log(stop_level, "%s", error)
        else:
            cause = "".join(traceback.format_exception_only(type(e), e)).strip()
            error = f"engine-core (pid {os.getpid()}) failed to start: {cause}"
            logger.error("%s\n%s", error, traceback.format_exc())
        _report_ready(ready_pipe, EngineCoreInfo(error=error))
        return 128 + stopped_by[0] if stopped_by else 1
    _report_ready(ready_pipe, proc.info())
    logger.info(
        "engine-core listening on %s (outputs on %s)", proc.input_address, proc.output_address
    )
    code = proc.run()
    if stopped_by:
        logger.log(stop_level, "%s", proc.stop_reason)
        if stopped_by[0] == signal.SIGINT:
            return 128 + signal.SIGINT
    return code


class _Interrupted(BaseException):
    """A stopping signal while the engine-core starts: unwinds the start-up (which stops
    the workers already started) without a traceback."""


def _report_ready(ready_pipe: Connection | None, info: EngineCoreInfo) -> None:
    """Tell the spawner how the start went; a spawner that is gone hears nothing."""
    if ready_pipe is None:
        return
    with contextlib.suppress(OSError):
        ready_pipe.send_bytes(msgspec.msgpack.encode(info))
    ready_pipe.close()
