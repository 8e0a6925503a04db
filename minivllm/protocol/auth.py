"""Who may talk to an engine-core: CurveZMQ on network addresses, a private directory for ipc.

An engine-core that listens on a tcp:// address other than loopback must hold a CURVE key
pair and a directory of the public keys of the clients it lets in; a client must hold the
engine-core's public key and a key pair of its own. Make keys with `minivllm keygen`. A peer
without the right keys gets no message at all: its handshake fails inside ZMQ. Loopback tcp
and ipc work without keys; an ipc socket must sit in a directory no other user can enter.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import stat
from dataclasses import dataclass

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CurveServerKeys:
    """An engine-core's CURVE key pair and where the public keys of its clients are."""

    public_key: bytes
    secret_key: bytes
    clients_dir: str  # *.key files (public keys, as `minivllm keygen` writes them)

    @classmethod
    def load(cls, secret_key_file: str, clients_dir: str) -> CurveServerKeys:
        public, secret = _load(secret_key_file, "--curve-secret-key", secret=True)
        if not os.path.isdir(clients_dir):
            raise ValueError(f"--curve-clients: {clients_dir!r} is not a directory")
        return cls(public, secret, clients_dir)


@dataclass(frozen=True)
class CurveClientKeys:
    """A client's CURVE key pair and the public key of the engine-core it talks to."""

    server_public_key: bytes
    public_key: bytes
    secret_key: bytes

    @classmethod
    def load(cls, server_key_file: str, secret_key_file: str) -> CurveClientKeys:
        """`server_key_file`: the engine-core's public key file (NAME.key);
        `secret_key_file`: this client's secret key file (NAME.key_secret)."""
        server_public, _ = _load(server_key_file, "server_key_file")
        public, secret = _load(secret_key_file, "secret_key_file", secret=True)
        return cls(server_public, public, secret)


def _load(path: str, what: str, secret: bool = False) -> tuple[bytes, bytes | None]:
    try:
        public, secret_key = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"{what}: cannot read a CURVE key from {path!r}: {e}") from None
    if secret and secret_key is None:
        raise ValueError(f"{what}: {path!r} holds no secret key (use NAME.key_secret)")
    return public, secret_key


def generate_keys(key_dir: str, name: str) -> tuple[str, str]:
    """Write NAME.key (public) and NAME.key_secret (mode 0600) into `key_dir`."""
    os.makedirs(key_dir, mode=0o700, exist_ok=True)
    old = os.umask(0o077)  # the secret is never readable by others, not even for a moment
    try:
        return zmq.auth.create_certificates(key_dir, name)
    finally:
        os.umask(old)


# ---------------------------------------------------------------- the engine-core's side


def check_listen_address(address: str, keys: CurveServerKeys | None) -> None:
    """ValueError unless `address` is safe to listen on: a network address needs keys, an
    ipc socket a directory that only this user can enter."""
    if address.startswith("tcp://"):
        host = address[len("tcp://") :].rsplit(":", 1)[0].strip("[]")
        if keys is None and not _is_loopback(host):
            raise ValueError(
                f"refusing to listen on {address} without authentication: a tcp address other "
                "than loopback needs --curve-secret-key and --curve-clients "
                "(make keys with `minivllm keygen`)"
            )
    elif address.startswith("ipc://"):
        directory = os.path.dirname(os.path.abspath(address[len("ipc://") :]))
        mode = stat.S_IMODE(os.stat(directory).st_mode)
        if mode & 0o077:
            raise ValueError(
                f"refusing to listen on {address}: its directory {directory} is open to other "
                f"users (mode {mode:o}); put the socket in a directory of mode 700"
            )


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a wildcard, an interface or a host name: reachable from elsewhere


def start_authenticator(ctx: zmq.Context, keys: CurveServerKeys) -> ThreadAuthenticator:
    """Let in only clients whose public key is in `keys.clients_dir` (read at each
    connection, so a client added there needs no restart); stop it before `ctx.term()`."""

    class Clients:
        def callback(self, domain: str, client_key: bytes) -> bool:
            allowed = zmq.auth.load_certificates(keys.clients_dir)
            if client_key not in allowed:
                logger.warning("refused a client whose CURVE key %s is not authorized", client_key)
                return False
            return True

    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve_callback(domain="*", credentials_provider=Clients())
    return auth


def serve_with(sock: zmq.Socket, keys: CurveServerKeys) -> None:
    """Make `sock` (before it binds) a CURVE server with `keys`."""
    sock.curve_secretkey = keys.secret_key
    sock.curve_publickey = keys.public_key
    sock.curve_server = True


def connect_with(sock: zmq.Socket, keys: CurveClientKeys) -> None:
    """Make `sock` (before it connects) a CURVE client with `keys`."""
    sock.curve_serverkey = keys.server_public_key
    sock.curve_publickey = keys.public_key
    sock.curve_secretkey = keys.secret_key
