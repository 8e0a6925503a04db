"""The frontend's side of an engine-core in another process, over ZMQ (sync or asyncio).

A multiprocess client either spawns its own engine-core (which dies with it) or attaches to
a running daemon (`connect`). Either way it says hello on the input socket, learns the
output address from the reply, registers its route on the output socket, and then sends a
heartbeat every second so the engine can abort the requests of a client that vanished.
It declares the engine dead when the engine says so, when a spawned engine-core's process
exits, when a daemon has been silent past its heartbeat (`PROBE_AFTER_S`) and nothing
listens at its address any more (it was killed: its socket refuses), or when nothing (not
even a heartbeat) has arrived for `ENGINE_TIMEOUT_S`; and itself dropped when the
engine-core says it heard nothing from it for its client timeout (an event loop that
stalled that long).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import secrets
import threading
import time
from collections import deque
from typing import Any, Self, TypeVar

import zmq
import zmq.asyncio

from minivllm.config import EngineConfig, ModelConfig
from minivllm.exceptions import EngineDeadError, EngineStartupError
from minivllm.frontend.clients.core_client import EngineCoreClient
from minivllm.frontend.clients.core_launch import EngineCoreLaunch
from minivllm.frontend.handshake_model import attached_model
from minivllm.frontend.tokenizer import Tokenizer
from minivllm.process_utils import describe_exit
from minivllm.protocol import transport
from minivllm.protocol.auth import CurveClientKeys
from minivllm.protocol.limits import MAX_ABORT_IDS
from minivllm.protocol.messages import (
    Abort,
    ClientHello,
    EngineCoreInfo,
    EngineCoreOutputs,
    EngineCoreRequest,
    Heartbeat,
    RouteReady,
    UtilityCall,
    UtilityMethod,
)
from minivllm.protocol.serial import CORE_TO_FRONTEND, MsgDecoder, MsgEncoder

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 30.0
ENGINE_TIMEOUT_S = 3.0  # the core heartbeats every 0.5 s
PROBE_AFTER_S = 0.7  # a daemon silent this long: is anything still listening at its address?
HEARTBEAT_INTERVAL_S = 1.0
_POLL_MS = 100
_READS_IN_A_ROW = 16  # messages read without a wait before the loop gets a turn
T = TypeVar("T")


class _MPClient:
    """Start (or attach to) an engine-core and complete the handshake, with sync sockets."""

    def __init__(
        self,
        config: EngineConfig | None = None,
        address: str | EngineCoreLaunch | None = None,
        curve: CurveClientKeys | None = None,
        has_tokenizer: bool = False,
    ) -> None:
        """`address`: a daemon's to attach to, or an engine-core launched for this client;
        None spawns one for `config`. `curve`: the keys a daemon on a network address asks
        for. `has_tokenizer`: this client loads its own, a daemon need not send it."""
        self.encoder, self.decoder = MsgEncoder(), MsgDecoder(CORE_TO_FRONTEND)
        self.curve = curve
        self.has_tokenizer = has_tokenizer
        self.launch: EngineCoreLaunch | None = None  # the engine-core this client spawned
        self.proc = None
        self.dead_reason: str | None = None
        self.client_id = secrets.randbits(31) + 1
        self.identity = self.client_id.to_bytes(4, "little")
        self._call_ids = itertools.count(1)
        self.ctx = zmq.Context()
        self.input_sock = self.output_sock = None
        try:
            if address is None:
                assert config is not None
                address = EngineCoreLaunch.start(config)
            if isinstance(address, EngineCoreLaunch):  # this client owns it from here on
                self.launch, self.proc = address, address.proc
                address = address.wait_ready()
            self.info = self._attach(address)
        except BaseException:
            self._close()
            raise
        self.last_heard = self._last_probe = time.monotonic()
        self._start_io()

    def _start_io(self) -> None:
        """Set up what the sync or asyncio side needs once the handshake is done."""
        raise NotImplementedError

    @classmethod
    def connect(
        cls, address: str, curve: CurveClientKeys | None = None, has_tokenizer: bool = False
    ) -> Self:
        """Attach to a running daemon at `address`."""
        return cls(address=address, curve=curve, has_tokenizer=has_tokenizer)

    def _attach(self, address: str) -> EngineCoreInfo:
        self.address = address
        try:
            transport.check_ipc_listener(address)
        except OSError as e:
            raise EngineStartupError(f"no engine-core at {address}: {e}") from None
        self.input_sock = transport.connect_socket(
            self.ctx, zmq.DEALER, address, identity=self.identity, curve=self.curve
        )
        hello = self.encoder.encode(ClientHello(self.client_id, has_tokenizer=self.has_tokenizer))
        transport.send_msg(self.input_sock, hello)
        info = self._wait_handshake(self.input_sock, EngineCoreInfo, address)
        if info.error:
            raise EngineStartupError(f"engine-core at {address} refused this client: {info.error}")
        output_address = transport.reachable_address(info.output_address, address)
        self.output_sock = transport.connect_socket(
            self.ctx, zmq.DEALER, output_address, identity=self.identity, curve=self.curve
        )
        transport.send_msg(self.output_sock, hello)
        self._wait_handshake(self.output_sock, RouteReady, output_address)
        return info

    def _wait_handshake(self, sock: zmq.Socket, reply: type[T], address: str) -> T:
        deadline = time.monotonic() + CONNECT_TIMEOUT_S
        while time.monotonic() < deadline:
            frames = transport.recv_msg(sock, timeout_ms=_POLL_MS)
            if frames is None:
                if self.proc is not None and not self.proc.is_alive():
                    raise EngineStartupError(describe_exit(self.proc))
                continue
            try:
                msg = self.decoder.decode(frames)
            except ValueError:
                continue
            if isinstance(msg, reply):
                return msg
        hint = ""
        if address.startswith("tcp://"):  # a failed CURVE handshake is silent by design
            hint = " (an engine-core with CURVE keys answers only clients holding the right ones)"
        raise EngineStartupError(
            f"no engine-core answered at {address} in {CONNECT_TIMEOUT_S:.0f} s{hint}"
        )

    def attached_model(self, tokenizer: str | None = None) -> tuple[ModelConfig, Tokenizer | None]:
        """The daemon's model config and the tokenizer to use, from its handshake (no model
        files needed here); `tokenizer`: a directory to load it from instead."""
        return attached_model(self.info, self.address, tokenizer)

    def _check_alive(self, heard_nothing: bool = False) -> None:
        """Raise EngineDeadError once the engine is gone, or has dropped this client. Silence
        counts only right after a receive came back empty (`heard_nothing`): when this
        client's own loop stalled, the engine's messages are waiting, not missing."""
        if self.dead_reason is None:
            silent = time.monotonic() - self.last_heard if heard_nothing else 0.0
            if self.proc is not None and not self.proc.is_alive():
                self.dead_reason = f"the engine is dead: {describe_exit(self.proc)}"
            elif silent > ENGINE_TIMEOUT_S:
                self.dead_reason = (
                    f"the engine is dead: engine-core silent for {ENGINE_TIMEOUT_S:.0f} s"
                )
            elif silent > PROBE_AFTER_S and self.proc is None and self._nothing_listens():
                self.dead_reason = (
                    f"the engine is dead: engine-core silent, and nothing listens at "
                    f"{self.address} any more"
                )
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)

    def _nothing_listens(self) -> bool:
        """Probe the daemon's address, at most every `PROBE_AFTER_S`."""
        now = time.monotonic()
        if now - self._last_probe < PROBE_AFTER_S:
            return False
        self._last_probe = now
        return transport.refuses_connections(self.address)

    def _decode_output(self, frames) -> EngineCoreOutputs | None:
        """Decode one frame set from the engine; None for heartbeats and noise."""
        self.last_heard = time.monotonic()
        msg = transport.decode_or_drop(self.decoder, frames, "the engine-core's output socket")
        if not isinstance(msg, EngineCoreOutputs):
            return None
        if msg.engine_dead is not None:
            self.dead_reason = f"the engine is dead: {msg.engine_dead}"
        if msg.client_dropped is not None:
            self.dead_reason = f"the engine-core dropped this client: {msg.client_dropped}"
        return msg

    def _close(self) -> None:
        for sock in (self.input_sock, self.output_sock):
            if sock is not None:
                sock.close(linger=0)
        self.input_sock = self.output_sock = None
        if self.launch is not None:
            self.launch.cancel()
        self.ctx.term()


class SyncMPClient(_MPClient, EngineCoreClient):
    """Blocking client; a small thread keeps the heartbeat going while the caller computes."""

    def _start_io(self) -> None:
        self._send_lock = threading.Lock()
        self._pending: deque[EngineCoreOutputs] = deque()
        self._utility: dict[int, Any] = {}
        self._closed = threading.Event()
        self._beat = threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True)
        self._beat.start()

    def _send(self, msg) -> None:
        frames = self.encoder.encode(msg)
        with self._send_lock:
            transport.send_msg(self.input_sock, frames)

    def _heartbeat_loop(self) -> None:
        beat = self.encoder.encode(Heartbeat(self.client_id))
        while not self._closed.wait(HEARTBEAT_INTERVAL_S) and self.dead_reason is None:
            with self._send_lock, contextlib.suppress(zmq.ZMQError):
                if self.input_sock is not None:
                    transport.send_msg(self.input_sock, beat, copy=True)

    def add_request(self, request: EngineCoreRequest) -> None:
        self._check_alive()
        self._send(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if self.dead_reason is None:
            for abort in _aborts(request_ids):
                self._send(abort)

    def _check_alive(self, heard_nothing: bool = False) -> None:
        # a caller that has not read for a while (idle between two generate calls) has the
        # engine's heartbeats waiting in the socket: they are its signs of life
        if self.dead_reason is None and time.monotonic() - self.last_heard > PROBE_AFTER_S:
            while (frames := transport.recv_msg(self.output_sock, timeout_ms=0)) is not None:
                self._take(frames)
            heard_nothing = True  # all that was waiting has been read
        super()._check_alive(heard_nothing)

    def _recv_one(self) -> None:
        frames = transport.recv_msg(self.output_sock, timeout_ms=_POLL_MS)
        if frames is not None:
            self._take(frames)
        self._check_alive()

    def _take(self, frames) -> None:
        msg = self._decode_output(frames)
        if msg is None:
            return
        if msg.utility_result is not None:
            self._utility[msg.utility_result.call_id] = msg.utility_result
        if msg.outputs:
            self._pending.append(msg)

    def get_output(self) -> EngineCoreOutputs:
        while not self._pending:
            self._recv_one()
        return self._pending.popleft()

    def call_utility(self, method: UtilityMethod) -> Any:
        self._check_alive()
        call_id = next(self._call_ids)
        self._send(UtilityCall(call_id, method))
        while call_id not in self._utility:
            self._recv_one()
        result = self._utility.pop(call_id)
        if result.error:
            raise RuntimeError(f"utility call {method.name} failed: {result.error}")
        return result.result

    def shutdown(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        with self._send_lock:
            self._close()


class AsyncMPClient(_MPClient):
    """asyncio client (works under uvloop). Outputs are read by a task started on first use."""

    def _start_io(self) -> None:
        # the handshake used the plain sockets; from here on the event loop owns them
        self.input_async = zmq.asyncio.Socket.from_socket(self.input_sock)
        self.output_async = zmq.asyncio.Socket.from_socket(self.output_sock)
        self.outputs: asyncio.Queue[EngineCoreOutputs | BaseException] | None = None
        self._utility: dict[int, asyncio.Future] = {}
        self._tasks: list[asyncio.Task] = []
        self._closed = False

    def _ensure_started(self) -> None:
        if self._tasks and not any(t.done() for t in self._tasks):
            return
        for task in self._tasks:  # a previous event loop's, if any
            task.cancel()
        self.outputs = asyncio.Queue()
        self._tasks = [
            asyncio.create_task(self._read_loop(), name="engine-core-outputs"),
            asyncio.create_task(self._heartbeat_loop(), name="engine-core-heartbeat"),
        ]

    async def _send(self, msg) -> None:
        await transport.send_msg_async(self.input_async, self.encoder.encode(msg))

    async def _heartbeat_loop(self) -> None:
        beat = self.encoder.encode(Heartbeat(self.client_id))
        while self.dead_reason is None:
            await asyncio.sleep(HEARTBEAT_INTERVAL_S)
            await transport.send_msg_async(self.input_async, beat, copy=True)

    async def _read_loop(self) -> None:
        assert self.outputs is not None
        in_a_row = 0
        try:
            while True:
                # what has arrived is read at once: a wait on the event loop (its futures,
                # reader callbacks and timer) costs more than a small message's handling,
                # and a data-parallel client gets a message per core per step
                frames = transport.recv_msg_nowait(self.output_sock)
                if frames is None:
                    in_a_row = 0
                    # poll, then receive what is there: cancelling a pending receive on a
                    # timeout could drop a message that had already arrived
                    if not await self.output_async.poll(_POLL_MS, zmq.POLLIN):
                        self._check_alive(heard_nothing=True)
                    continue
                in_a_row += 1
                if in_a_row % _READS_IN_A_ROW == 0:
                    await asyncio.sleep(0)  # a long backlog leaves the event loop its turns
                msg = self._decode_output(frames)
                if msg is None:
                    continue
                if msg.utility_result is not None:
                    fut = self._utility.pop(msg.utility_result.call_id, None)
                    if fut is not None and not fut.done():
                        fut.set_result(msg.utility_result)
                if msg.outputs:
                    self.outputs.put_nowait(msg)
                self._check_alive()
        except EngineDeadError as e:
            self.outputs.put_nowait(e)
            for fut in self._utility.values():
                if not fut.done():
                    fut.set_exception(EngineDeadError(str(e)))

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        self._ensure_started()
        self._check_alive()
        await self._send(request)

    async def add_requests_async(self, requests: list[EngineCoreRequest]) -> None:
        """The n > 1 children of one user request (a data-parallel client keeps them on
        one core)."""
        for request in requests:
            await self.add_request_async(request)

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        if self.dead_reason is None and not self._closed:
            for abort in _aborts(request_ids):
                await self._send(abort)

    async def get_output_async(self) -> EngineCoreOutputs:
        self._ensure_started()
        assert self.outputs is not None
        msg = await self.outputs.get()
        if isinstance(msg, BaseException):
            self.outputs.put_nowait(msg)  # every later caller learns it too
            raise msg
        return msg

    async def call_utility_async(self, method: UtilityMethod) -> Any:
        self._ensure_started()
        self._check_alive()
        call_id = next(self._call_ids)
        fut = asyncio.get_running_loop().create_future()
        self._utility[call_id] = fut
        await self._send(UtilityCall(call_id, method))
        result = await fut
        if result.error:
            raise RuntimeError(f"utility call {method.name} failed: {result.error}")
        return result.result

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        for task in self._tasks:
            task.cancel()
        transport.close_shadowed(self.input_async, self.input_sock)
        transport.close_shadowed(self.output_async, self.output_sock)
        self.input_sock = self.output_sock = None
        self._close()


def _aborts(request_ids: list[str]) -> list[Abort]:
    """`request_ids` as Abort messages of at most `MAX_ABORT_IDS` ids each."""
    step = MAX_ABORT_IDS
    return [Abort(request_ids[i : i + step]) for i in range(0, len(request_ids), step)]
