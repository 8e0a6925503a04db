"""ZMQ sockets for the frontend ⇄ engine-core ⇄ worker links: addresses, options, send/recv.

Sockets are created here with the same options everywhere: unbounded high-water marks (a
message ZMQ accepted is never dropped), a bounded frame size (`zmq.MAXMSGSIZE`: a bigger
frame is refused from its size header and its connection closed), a bounded linger (closing
never hangs for long) and IPv6 when the address needs it. ROUTER sockets prefix every message with the peer's
identity frame; `send_to`/`recv_from` add and strip it.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import zmq
import zmq.asyncio

from minivllm.protocol import auth
from minivllm.protocol.auth import CurveClientKeys, CurveServerKeys
from minivllm.protocol.limits import MAX_MESSAGE_BYTES
from minivllm.protocol.serial import ProtocolError

logger = logging.getLogger(__name__)

# Closing a socket waits at most this long for queued messages (a final "engine dead"
# frame still gets out); shutdown paths close with linger=0.
DEFAULT_LINGER_MS = 1000
# sockaddr_un.sun_path is 108 bytes on Linux (104 on macOS), including the NUL.
_MAX_IPC_PATH = 103

Frames = Sequence[Any]  # bytes, bytearray, memoryview or zmq.Frame


# ---------------------------------------------------------------- addresses


def make_ipc_dir(prefix: str = "minivllm-") -> str:
    """Create a private (mode 0700) directory for one engine's ipc:// sockets.

    Remove it with `cleanup_ipc(path)` when the engine closes. Falls back to /tmp when
    $TMPDIR is too long to hold socket paths.
    """
    base = tempfile.gettempdir()
    if len(base) > _MAX_IPC_PATH - 40:
        base = "/tmp"
    path = tempfile.mkdtemp(prefix=prefix, dir=base)  # mkdtemp creates it 0700
    os.chmod(path, 0o700)  # in case a umask or filesystem widened it
    return path


def ipc_address(ipc_dir: str, name: str) -> str:
    """`ipc://<ipc_dir>/<name>`; raises ValueError if the path is too long for a socket."""
    path = os.path.join(ipc_dir, name)
    if len(path.encode()) > _MAX_IPC_PATH:
        raise ValueError(f"ipc socket path too long ({len(path)} > {_MAX_IPC_PATH} bytes): {path}")
    return f"ipc://{path}"


def check_ipc_listener(address: str) -> None:
    """For an `ipc://` address, raise an OSError naming the path unless a socket there
    accepts connections (ZMQ itself would retry in silence). Other addresses pass."""
    if not address.startswith("ipc://"):
        return
    path = address[len("ipc://") :]
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} does not exist")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except ConnectionRefusedError:
        raise ConnectionRefusedError(f"nothing listens on {path} (a stale socket file?)") from None
    finally:
        probe.close()


def refuses_connections(address: str, timeout_s: float = 0.05) -> bool:
    """Whether nothing listens at `address` any more: an ipc path that is gone or refuses,
    a tcp port that refuses. False when unsure (a host that does not answer in `timeout_s`):
    a silent peer is then left to its heartbeat timeout."""
    if address.startswith("ipc://"):
        try:
            check_ipc_listener(address)
        except (FileNotFoundError, ConnectionRefusedError):
            return True
        except OSError:
            return False
        return False
    if not address.startswith("tcp://"):
        return False
    host, port = address[len("tcp://") :].rsplit(":", 1)
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except ConnectionRefusedError:
        return True
    except (OSError, ValueError):
        return False
    return False


def tcp_address(host: str = "127.0.0.1", port: int = 0) -> str:
    """`tcp://host:port`, with brackets for IPv6 hosts. Port 0: the OS picks one at bind."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"tcp://{host}:{port}"


def reachable_address(bound: str, via: str) -> str:
    """`bound`, an address a peer bound (on tcp perhaps a wildcard host: 0.0.0.0, ::, *), as
    this side reaches it: on the host of `via`, the address that reached that peer."""
    if not (bound.startswith("tcp://") and via.startswith("tcp://")):
        return bound
    host, port = bound[len("tcp://") :].rsplit(":", 1)
    if host.strip("[]") not in ("0.0.0.0", "::", "*"):
        return bound
    return f"tcp://{via[len('tcp://') :].rsplit(':', 1)[0]}:{port}"


def cleanup_ipc(ipc_dir: str) -> None:
    """Remove the socket files in `ipc_dir` and the directory itself; missing is fine."""
    shutil.rmtree(ipc_dir, ignore_errors=True)


# ---------------------------------------------------------------- sockets


def _new_socket(
    ctx: zmq.Context, socket_type: int, address: str, max_message_bytes: int
) -> zmq.Socket:
    sock = ctx.socket(socket_type)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
    sock.setsockopt(zmq.LINGER, DEFAULT_LINGER_MS)
    if address.startswith("tcp://["):
        sock.setsockopt(zmq.IPV6, 1)
    if socket_type == zmq.ROUTER:
        # Sending to a peer that is gone raises EHOSTUNREACH instead of vanishing silently.
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    return sock


def bind_socket(
    ctx: zmq.Context,
    socket_type: int,
    address: str,
    max_message_bytes: int = MAX_MESSAGE_BYTES,
    curve: CurveServerKeys | None = None,
) -> tuple[zmq.Socket, str]:
    """Create a socket bound to `address`; returns it and the real address (tcp port 0
    becomes the chosen port). With `curve`, only CURVE clients the context's authenticator
    lets in can talk to it (see auth.py). Works with `zmq.asyncio.Context` too."""
    sock = _new_socket(ctx, socket_type, address, max_message_bytes)
    if curve is not None:
        auth.serve_with(sock, curve)
    try:
        sock.bind(address)
    except zmq.ZMQError:
        sock.close(linger=0)
        raise
    bound = sock.getsockopt(zmq.LAST_ENDPOINT)
    return sock, bound.decode() if isinstance(bound, bytes) else bound


def connect_socket(
    ctx: zmq.Context,
    socket_type: int,
    address: str,
    identity: bytes | None = None,
    max_message_bytes: int = MAX_MESSAGE_BYTES,
    curve: CurveClientKeys | None = None,
) -> zmq.Socket:
    """Create a socket connected to `address`. `identity` names a DEALER to its ROUTER peer
    (it must be unique among that ROUTER's peers); `curve` holds the keys a CURVE server
    asks for."""
    sock = _new_socket(ctx, socket_type, address, max_message_bytes)
    if curve is not None:
        auth.connect_with(sock, curve)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    sock.connect(address)
    return sock


def close_shadowed(shadow: zmq.asyncio.Socket, owner: zmq.Socket) -> None:
    """Close a socket that an asyncio shadow wraps: through the shadow, which leaves the
    event loop, then make the owner object notice at once. Left to notice later, the owner
    (when garbage-collected) may find a live socket at its old address, which libzmq reuses
    for new sockets, and close that one: another client's, in this process."""
    shadow.close(linger=0)
    if not owner.closed:  # asks libzmq now, while the old address still answers ENOTSOCK
        owner.close(linger=0)


def close_and_flush(sock: zmq.Socket) -> None:
    """Close `sock` and return once what was sent on it has left, or its bounded linger ran
    out, by terminating its context: `sock` must be that context's last open socket.
    Closing alone returns at once and leaves the sending to ZMQ's I/O thread, which a
    process that exits right after (`os._exit`) takes down with the unsent frames."""
    ctx = sock.context
    sock.close()
    ctx.term()


# ---------------------------------------------------------------- send / recv


def send_msg(sock: zmq.Socket, frames: Frames, copy: bool = False) -> None:
    """Send one multipart message. With copy=False the frames must not be mutated afterwards
    (ZMQ still copies frames under `zmq.COPY_THRESHOLD` bytes, where that is cheaper)."""
    sock.send_multipart(frames, copy=copy)


def recv_msg(
    sock: zmq.Socket, timeout_ms: int | None = None, spin_s: float = 0.0
) -> list[memoryview] | None:
    """Receive one multipart message as memoryviews over ZMQ's buffers (no copy), or None
    if nothing arrived within `timeout_ms` (None waits forever). `spin_s`: first poll for
    that long without sleeping, so a message that comes soon finds the thread awake (see
    `envs.spin_wait_s`); the spin counts towards `timeout_ms`."""
    if spin_s:
        end = time.perf_counter() + spin_s
        # (each look hands the GIL to other threads while ZMQ checks the socket)
        while (frames := recv_msg_nowait(sock)) is None and time.perf_counter() < end:
            pass
        if frames is not None:
            return frames
        if timeout_ms is not None:
            timeout_ms = max(0, timeout_ms - int(1000 * spin_s))
    if timeout_ms is not None and not sock.poll(timeout_ms, zmq.POLLIN):
        return None
    return [frame.buffer for frame in sock.recv_multipart(copy=False)]


def check_size(frames: Frames, what: str, limit: int = MAX_MESSAGE_BYTES) -> None:
    """Raise ValueError if a frame is over `limit`: the peer's socket would refuse it and
    close the connection for good, so the sender must fail loudly instead."""
    for frame in frames:
        if memoryview(frame).nbytes > limit:
            raise ValueError(
                f"{what}: a frame of {memoryview(frame).nbytes} bytes is over the "
                f"{limit}-byte limit"
            )


def send_to(sock: zmq.Socket, identity: bytes, frames: Frames, copy: bool = False) -> None:
    """Send `frames` from a ROUTER socket to the peer named `identity`."""
    sock.send_multipart([identity, *frames], copy=copy)


def recv_from(
    sock: zmq.Socket, timeout_ms: int | None = None
) -> tuple[bytes, list[memoryview]] | None:
    """Receive on a ROUTER socket: (peer identity, frames), or None on timeout."""
    frames = recv_msg(sock, timeout_ms)
    if frames is None:
        return None
    return frames[0].tobytes(), frames[1:]  # ROUTER always prepends the identity frame


def peer_of(frame: Any) -> str:
    """Who sent a received frame (a memoryview from `recv_msg`, or a zmq.Frame), for logs:
    "127.0.0.1" over tcp, "pid 1234 (uid 1000)" over ipc (the kernel's peer credentials)."""
    frame = getattr(frame, "obj", frame)  # recv_msg's memoryviews keep their zmq.Frame
    try:
        address = frame.get("Peer-Address")
    except (AttributeError, zmq.ZMQError):
        return "an unknown peer"
    host, _, cred = address.partition(":")
    parts = cred.split(":")
    if host == "localhost" and len(parts) == 3:  # ipc: uid:gid:pid
        return f"pid {parts[2]} (uid {parts[0]})"
    return address


def decode_or_drop(decoder: Any, frames: Frames, where: str, who: str = "") -> Any:
    """`decoder.decode(frames)`, or None for frames that do not decode: such a message is
    dropped, never fatal, with a warning naming `where` it came in and the peer that sent it."""
    try:
        return decoder.decode(frames)
    except ProtocolError as e:
        peer = peer_of(frames[0])
        logger.warning("%sdropped a message on %s from %s: %s", who, where, peer, e)
        return None


async def send_msg_async(sock: zmq.asyncio.Socket, frames: Frames, copy: bool = False) -> None:
    """`send_msg` for asyncio sockets (the frontend)."""
    await sock.send_multipart(frames, copy=copy)


def recv_msg_nowait(sock: zmq.Socket) -> list[memoryview] | None:
    """`recv_msg` of a message that has arrived, or None at once if none has."""
    try:
        return [frame.buffer for frame in sock.recv_multipart(zmq.NOBLOCK, copy=False)]
    except zmq.Again:
        return None


async def recv_msg_async(sock: zmq.asyncio.Socket) -> list[memoryview]:
    """`recv_msg` for asyncio sockets; wrap in `asyncio.wait_for` for a timeout."""
    return [frame.buffer for frame in await sock.recv_multipart(copy=False)]
