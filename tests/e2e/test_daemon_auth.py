"""A daemon on a network address: no keys, no start; with CURVE keys, only clients holding
an authorized key pair and the daemon's public key are served, and any other peer gets
nothing back, not even an error. Loopback tcp keeps working without keys."""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys

import pytest
import zmq
import zmq.auth

from minivllm import LLM, CurveClientKeys
from minivllm.protocol.messages import ClientHello
from minivllm.protocol.serial import MsgEncoder
from tests.e2e.daemon import Daemon, env, greedy, null_tokens
from tests.tiny_models import build_null_checkpoint

CLI = [sys.executable, "-m", "minivllm.frontend.cli"]


@pytest.fixture(scope="module")
def null_dir(tmp_path_factory) -> str:
    return build_null_checkpoint(str(tmp_path_factory.mktemp("null")))


def _refusal(null_dir: str, address: str) -> str:
    proc = subprocess.run(
        [*CLI, "engine-core", "--model", null_dir, "--address", address],
        capture_output=True,
        text=True,
        timeout=60,
        env=env(),
    )
    assert proc.returncode != 0
    return proc.stderr


def test_daemon_refuses_unsafe_addresses(null_dir: str, tmp_path) -> None:
    err = _refusal(null_dir, "tcp://0.0.0.0:0")
    assert "refusing to listen on tcp://0.0.0.0:0 without authentication" in err
    assert "--curve-secret-key" in err
    open_dir = tmp_path / "open"
    open_dir.mkdir(mode=0o755)
    os.chmod(open_dir, 0o755)
    err = _refusal(null_dir, f"ipc://{open_dir}/engine")
    assert f"its directory {open_dir} is open to other users (mode 755)" in err


def _port(daemon: Daemon) -> int:
    found = re.search(r"engine-core listening on tcp://[^:]+:(\d+)", daemon.log())
    assert found, daemon.log()
    return int(found.group(1))


def _silent(address: str, setup, seconds: float = 3.0) -> bool:
    """Connect a DEALER set up by `setup`, say hello; True if nothing at all comes back."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, (12345).to_bytes(4, "little"))
    setup(sock)
    sock.connect(address)
    sock.send_multipart(MsgEncoder().encode(ClientHello(12345)))
    silent = not sock.poll(int(seconds * 1000))
    sock.close(linger=0)
    ctx.term()
    return silent


def test_curve_keys_decide_who_is_served(null_dir: str, tmp_path) -> None:
    keys, clients = tmp_path / "keys", tmp_path / "keys" / "clients"
    for key_dir, name in ((keys, "server"), (clients, "client")):
        out = subprocess.run(
            [*CLI, "keygen", str(key_dir), "--name", name],
            capture_output=True,
            text=True,
            env=env(),
        )
        assert out.returncode == 0, out.stderr
        assert stat.S_IMODE(os.stat(key_dir / f"{name}.key_secret").st_mode) == 0o600
    daemon = Daemon(
        null_dir,
        "tcp://0.0.0.0:0",
        str(tmp_path / "daemon.log"),
        "--curve-secret-key",
        str(keys / "server.key_secret"),
        "--curve-clients",
        str(clients),
    )
    try:
        daemon.wait_listening()
        address = f"tcp://127.0.0.1:{_port(daemon)}"
        server_public, _ = zmq.auth.load_certificate(str(keys / "server.key"))
        stranger_public, stranger_secret = zmq.curve_keypair()

        def no_keys(sock: zmq.Socket) -> None:
            pass

        def wrong_server_key(sock: zmq.Socket) -> None:
            client_public, client_secret = zmq.auth.load_certificate(
                str(clients / "client.key_secret")
            )
            sock.curve_serverkey, sock.curve_publickey = stranger_public, client_public
            sock.curve_secretkey = client_secret

        def unknown_client(sock: zmq.Socket) -> None:
            sock.curve_serverkey = server_public
            sock.curve_publickey, sock.curve_secretkey = stranger_public, stranger_secret

        for setup in (no_keys, wrong_server_key, unknown_client):
            assert _silent(address, setup), f"{setup.__name__}: the daemon answered"
        assert "is not authorized" in daemon.log()
        assert "dropped a message" not in daemon.log(), "nothing of theirs was even decoded"

        curve = CurveClientKeys.load(str(keys / "server.key"), str(clients / "client.key_secret"))
        llm = LLM.connect(address, curve=curve)
        try:
            out = llm.generate([[1, 2, 3]], greedy(12), use_tqdm=False)
        finally:
            llm.shutdown()
        assert list(out[0].outputs[0].token_ids) == null_tokens(3, 12)
    finally:
        daemon.stop()


def test_loopback_tcp_needs_no_keys(null_dir: str, tmp_path) -> None:
    daemon = Daemon(null_dir, "tcp://127.0.0.1:0", str(tmp_path / "daemon.log"))
    try:
        daemon.wait_listening()
        daemon.address = f"tcp://127.0.0.1:{_port(daemon)}"
        assert not _silent(daemon.address, lambda sock: None), "a keyless hello is answered"
        daemon.canary()
    finally:
        daemon.stop()
