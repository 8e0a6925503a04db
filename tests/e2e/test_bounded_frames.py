"""A 100 MB frame sent to any socket of a live engine-core is refused from its size header:
neither the engine-core nor its worker grows by it, and the engine keeps serving."""

from __future__ import annotations

import time

import zmq

from tests.e2e.daemon import Daemon

FRAME = 100 << 20


def test_a_100mb_frame_is_refused_without_memory_growth(null_daemon: Daemon) -> None:
    daemon = null_daemon
    daemon.canary()  # warm: the first request's allocations are not the frame's
    before = daemon.rss()
    targets = [
        (daemon.address, zmq.DEALER),  # requests
        (daemon.address + ".out", zmq.DEALER),  # the clients' output routes
        (daemon.results_socket(), zmq.PUSH),  # the workers' results
    ]
    ctx = zmq.Context()
    frame = b"R" + bytes(FRAME)
    socks = []
    for address, kind in targets:
        sock = ctx.socket(kind)
        sock.connect(address)
        sock.send(frame, copy=False)
        socks.append(sock)
    time.sleep(3.0)  # far longer than moving 100 MB over a local socket takes
    after = daemon.rss()
    for sock in socks:
        sock.close(linger=0)
    ctx.term()
    grown = {pid: (after[pid] - before[pid]) >> 20 for pid in before}
    assert all(mb < 20 for mb in grown.values()), f"MiB grown per process: {grown}"
    daemon.canary()
