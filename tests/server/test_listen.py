"""The server's listening sockets: one per API process on one port, and a port another
server listens on refused, whether or not that server's sockets share their port."""

from __future__ import annotations

import socket
import sys

import pytest

from minivllm.frontend.server.listen import bind_listeners


def _close(sockets: list[socket.socket]) -> None:
    for sock in sockets:
        sock.close()


def test_one_socket_per_api_process_on_one_port() -> None:
    sockets = bind_listeners("127.0.0.1", 0, 3)
    try:
        ports = {s.getsockname()[1] for s in sockets}
        assert len(ports) == 1
        assert len(sockets) == (3 if sys.platform.startswith("linux") else 1)
    finally:
        _close(sockets)


@pytest.mark.parametrize("count", [1, 2])
def test_a_port_another_server_listens_on_is_refused(count: int) -> None:
    first = bind_listeners("127.0.0.1", 0, 2)
    try:
        for sock in first:
            sock.listen()
        with pytest.raises(OSError):
            _close(bind_listeners("127.0.0.1", first[0].getsockname()[1], count))
    finally:
        _close(first)
