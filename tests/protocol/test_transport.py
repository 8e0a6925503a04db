"""Sockets round-trip typed messages over ipc:// and tcp://, and ROUTER replies reach their peer."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import stat

import pytest
import zmq
import zmq.asyncio

from minivllm.protocol.messages import Abort, EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest
from minivllm.protocol.sampling_params import SamplingParams
from minivllm.protocol.serial import CORE_TO_FRONTEND, FRONTEND_TO_CORE, MsgDecoder, MsgEncoder
from minivllm.protocol.transport import (
    bind_socket,
    cleanup_ipc,
    close_and_flush,
    connect_socket,
    ipc_address,
    make_ipc_dir,
    recv_from,
    recv_msg,
    recv_msg_async,
    send_msg,
    send_msg_async,
    send_to,
    tcp_address,
)

TIMEOUT_MS = 5000


@pytest.fixture
def ctx():
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


@pytest.fixture
def ipc_dir():
    path = make_ipc_dir()
    yield path
    cleanup_ipc(path)


@pytest.fixture(params=["ipc", "tcp"])
def address(request, ipc_dir: str) -> str:
    return ipc_address(ipc_dir, "input") if request.param == "ipc" else tcp_address()


def test_ipc_dir_is_private_and_removed() -> None:
    path = make_ipc_dir()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o700
    open(os.path.join(path, "stale.sock"), "w").close()
    cleanup_ipc(path)
    assert not os.path.exists(path)
    cleanup_ipc(path)  # twice is fine


def test_addresses() -> None:
    assert tcp_address() == "tcp://127.0.0.1:0"
    assert tcp_address("::1", 5555) == "tcp://[::1]:5555"
    assert ipc_address("/tmp/x", "in") == "ipc:///tmp/x/in"
    with pytest.raises(ValueError, match="too long"):
        ipc_address("/tmp/" + "d" * 200, "in")


def test_tcp_port_zero_returns_real_port(ctx: zmq.Context) -> None:
    sock, bound = bind_socket(ctx, zmq.PULL, tcp_address())
    try:
        assert bound.startswith("tcp://127.0.0.1:")
        assert int(bound.rsplit(":", 1)[1]) > 0
    finally:
        sock.close(linger=0)


def test_push_pull_round_trip(ctx: zmq.Context, address: str) -> None:
    pull, bound = bind_socket(ctx, zmq.PULL, address)
    push = connect_socket(ctx, zmq.PUSH, bound)
    msgs = [
        EngineCoreRequest("r1", list(range(5000)), SamplingParams(max_tokens=3)),  # id frame
        Abort(["r1"]),
    ]
    try:
        for msg in msgs:
            send_msg(push, MsgEncoder().encode(msg))
        decoder = MsgDecoder(FRONTEND_TO_CORE)
        got = [decoder.decode(recv_msg(pull, TIMEOUT_MS)) for _ in msgs]
        assert got == msgs
        assert recv_msg(pull, timeout_ms=10) is None
    finally:
        push.close(linger=0)
        pull.close(linger=0)


def _send_and_exit(address: str, nbytes: int) -> None:
    push = connect_socket(zmq.Context(), zmq.PUSH, address)
    send_msg(push, [b"x" * nbytes])
    close_and_flush(push)
    os._exit(1)  # as a failing worker does, right after


def test_a_frame_sent_before_exiting_arrives(ctx: zmq.Context, address: str) -> None:
    # 64 MiB: far more than ZMQ sends before a plain close returns, so without the flush
    # the exit takes the frame down (every time, on a 2-core machine)
    pull, bound = bind_socket(ctx, zmq.PULL, address)
    proc = multiprocessing.get_context("spawn").Process(
        target=_send_and_exit, args=(bound, 64 << 20)
    )
    try:
        proc.start()
        proc.join(30)
        assert proc.exitcode == 1
        frames = recv_msg(pull, TIMEOUT_MS)
        assert frames is not None and len(frames[0]) == 64 << 20
    finally:
        pull.close(linger=0)


def test_router_dealer_routes_by_identity(ctx: zmq.Context, address: str) -> None:
    router, bound = bind_socket(ctx, zmq.ROUTER, address)
    clients = {ident: connect_socket(ctx, zmq.DEALER, bound, ident) for ident in (b"c0", b"c1")}
    encoder, core_decoder = MsgEncoder(), MsgDecoder(FRONTEND_TO_CORE)
    client_decoder = MsgDecoder(CORE_TO_FRONTEND)
    try:
        for ident, sock in clients.items():
            req = EngineCoreRequest(f"req-{ident.decode()}", [1, 2], SamplingParams())
            send_msg(sock, encoder.encode(req))
        for _ in clients:
            identity, frames = recv_from(router, TIMEOUT_MS)
            req = core_decoder.decode(frames)
            assert req.request_id == f"req-{identity.decode()}"
            out = EngineCoreOutputs([EngineCoreOutput(req.request_id, [7])])
            send_to(router, identity, encoder.encode(out))
        for ident, sock in clients.items():
            outs = client_decoder.decode(recv_msg(sock, TIMEOUT_MS))
            assert outs.outputs[0].request_id == f"req-{ident.decode()}"
        # A peer that never connected is an error, not a silent drop.
        with pytest.raises(zmq.ZMQError):
            send_to(router, b"nobody", encoder.encode(EngineCoreOutputs()))
    finally:
        for sock in (*clients.values(), router):
            sock.close(linger=0)


def test_asyncio_sockets(ipc_dir: str) -> None:
    async def main() -> None:
        actx = zmq.asyncio.Context()
        pull, bound = bind_socket(actx, zmq.PULL, ipc_address(ipc_dir, "out"))
        push = connect_socket(actx, zmq.PUSH, bound)
        try:
            out = EngineCoreOutputs([EngineCoreOutput("r", [1, 2])], timestamp=1.0)
            await send_msg_async(push, MsgEncoder().encode(out))
            frames = await asyncio.wait_for(recv_msg_async(pull), TIMEOUT_MS / 1000)
            assert MsgDecoder(CORE_TO_FRONTEND).decode(frames) == out
        finally:
            push.close(linger=0)
            pull.close(linger=0)
            actx.term()

    asyncio.run(main())


def test_a_spinning_receive_gets_what_comes_during_the_spin(ctx: zmq.Context, address: str) -> None:
    """`spin_s` polls awake before sleeping: a message sent meanwhile is received, nothing
    sent gives None once the spin and the rest of the timeout are over."""
    import threading
    import time

    pull, bound = bind_socket(ctx, zmq.PULL, address)
    push = connect_socket(ctx, zmq.PUSH, bound)
    try:
        sender = threading.Timer(0.05, lambda: send_msg(push, [b"late", b"frames"]))
        sender.start()
        start = time.perf_counter()
        frames = recv_msg(pull, timeout_ms=TIMEOUT_MS, spin_s=1.0)
        sender.join()
        assert [bytes(f) for f in frames] == [b"late", b"frames"]
        assert time.perf_counter() - start < 0.9  # returned when it came, not after the spin
        start = time.perf_counter()
        assert recv_msg(pull, timeout_ms=200, spin_s=0.05) is None
        assert 0.15 < time.perf_counter() - start < 2.0
    finally:
        push.close(linger=0)
        pull.close(linger=0)


def test_only_cuda_engines_spin(monkeypatch: pytest.MonkeyPatch) -> None:
    from minivllm import envs

    assert envs.spin_wait_s("cpu") == 0.0
    assert envs.spin_wait_s("cuda") == 0.003
    monkeypatch.setenv("MINIVLLM_SPIN_WAIT_US", "0")
    assert envs.spin_wait_s("cuda") == 0.0
