"""The server's listening sockets: one, or one per API process on the same port.

Several processes accepting from one shared socket split a burst of connections (a
benchmark's or a load balancer's pool) unevenly: every idle process wakes on a new
connection and asyncio's accept loop drains the queue in the one that runs first; 512
connections from 8 threads split up to 2:1 between two idle processes. Where the kernel
balances a port between sockets (SO_REUSEPORT on Linux hashes each connection to one of
them), each API process gets its own socket instead; elsewhere they share one.
"""

from __future__ import annotations

import socket
import sys


def _balances_reuseport() -> bool:
    return sys.platform.startswith("linux") and hasattr(socket, "SO_REUSEPORT")


def _bound(host: str, port: int, reuseport: bool) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuseport:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except BaseException:
        sock.close()
        raise
    return sock


def bind_listeners(host: str, port: int, count: int) -> list[socket.socket]:
    """`count` sockets bound to `host:port` (port 0: one free port for all), one per API
    process where the kernel balances them, else one socket shared by all (a list of one).
    Raises OSError if the port cannot be bound."""
    if count == 1 or not _balances_reuseport():
        return [_bound(host, port, False)]
    # A plain bind first: it fails on a port in use, also by another server's SO_REUSEPORT
    # sockets, which the sockets below could otherwise join and split its connections with.
    with _bound(host, port, False) as probe:
        port = probe.getsockname()[1]
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            sockets.append(_bound(host, port, True))
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets
