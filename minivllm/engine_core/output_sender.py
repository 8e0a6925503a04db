"""The engine-core's output thread: every client gets its own outputs, and only those.

The busy loop hands over each step's outputs as one item, `{client id: EngineCoreOutputs}`:
a client gets one message per step in which it has outputs, encoded for it alone, so a
step costs the same per client however many are attached. Other messages come as
`(client id, EngineCoreOutputs)`: utility results, a dropped client's last notice, and the
engine's death (`ALL`: every client). A client is routable once its hello has come on the
output socket; what is due to it before waits. Every routable client gets a heartbeat each
`HEARTBEAT_INTERVAL_S`.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable
from typing import Any

import zmq

from minivllm.protocol import transport
from minivllm.protocol.messages import ClientHello, EngineCoreOutputs, Heartbeat, RouteReady
from minivllm.protocol.serial import MsgDecoder, MsgEncoder

HEARTBEAT_INTERVAL_S = 0.5  # core -> clients, so a client notices a dead daemon quickly
ALL = -1  # address of a message for every attached client
STOP = object()  # the last item: the thread returns

# (decoder, sender identity, frames, where) -> (client id, message) or None
DecodeFromClient = Callable[[MsgDecoder, bytes, list, str], tuple[int, Any] | None]


class OutputSender:
    """Runs in the output thread (`run`); owns the output socket's sends."""

    def __init__(self, sock: zmq.Socket, decode_from_client: DecodeFromClient) -> None:
        self.sock = sock
        self.decode_from_client = decode_from_client
        self.encoder = MsgEncoder()
        self.hello_decoder = MsgDecoder([ClientHello])  # all the output socket receives
        self.routable: set[int] = set()
        self.pending: dict[int, list[Any]] = {}

    def run(self, items: queue.Queue[Any]) -> None:
        heartbeat = self.encoder.encode(Heartbeat())
        next_beat = time.monotonic() + HEARTBEAT_INTERVAL_S
        while True:
            self._open_routes()
            try:
                item = items.get(timeout=0.05)
            except queue.Empty:
                item = None
            if item is STOP:
                return
            if isinstance(item, dict):  # one step's outputs
                for client, msg in item.items():
                    self._deliver(client, msg)
            elif item is not None:
                self._deliver(*item)
            now = time.monotonic()
            if now >= next_beat:
                next_beat = now + HEARTBEAT_INTERVAL_S
                for client in list(self.routable):
                    self._send(client, heartbeat)

    def _open_routes(self) -> None:
        """Clients registering their output route: answered, and sent what waited."""
        while self.sock.poll(0):
            got = transport.recv_from(self.sock)
            decoded = self.decode_from_client(self.hello_decoder, *got, "output")
            if decoded is None:
                continue
            client = decoded[0]
            self.routable.add(client)
            self._send(client, self.encoder.encode(RouteReady(client)))
            for frames in self.pending.pop(client, []):
                self._send(client, frames)

    def _deliver(self, client: int, msg: EngineCoreOutputs) -> None:
        routable = self.routable
        if msg.client_dropped is not None:  # its last message, if it still listens
            if client in routable:
                self._send(client, self.encoder.encode(msg))
            routable.discard(client)
            self.pending.pop(client, None)
        elif client == ALL:
            frames = self.encoder.encode(msg)
            for c in list(routable):
                self._send(c, frames)
        elif client in routable:
            self._send(client, self.encoder.encode(msg))
        else:
            self.pending.setdefault(client, []).append(self.encoder.encode(msg))

    def _send(self, client: int, frames: list) -> None:
        try:
            transport.send_to(self.sock, client.to_bytes(4, "little"), frames)
        except zmq.ZMQError:
            self.routable.discard(client)  # the peer is gone
