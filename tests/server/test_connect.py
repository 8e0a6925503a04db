"""Two API processes (`minivllm serve --connect`) on one engine-core daemon: both serve,
each counts its own requests, and one leaving harms neither the daemon nor the other."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import httpx
import pytest

from minivllm.frontend.clients.mp_client import SyncMPClient
from tests.process_helpers import wait_for_ipc_socket
from tests.server.conftest import server_env, stop_cleanly


@pytest.fixture(scope="module")
def daemon(qwen3_dir: str, tmp_path_factory):
    address = f"ipc://{tmp_path_factory.mktemp('daemon')}/engine.sock"
    cmd = [sys.executable, "-m", "minivllm.frontend.cli", "engine-core", "--model", qwen3_dir]
    proc = subprocess.Popen(
        [*cmd, "--dtype", "float32", "--address", address],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=server_env(),
    )
    wait_for_ipc_socket(address)
    SyncMPClient.connect(address).shutdown()  # returns once the daemon answers
    yield address
    proc.terminate()
    assert proc.wait(timeout=30) == 0


def test_two_api_servers_share_one_daemon(daemon: str, server_factory) -> None:
    a = server_factory(["--connect", daemon, "--served-model-name", "tiny"])
    b = server_factory(["--connect", daemon, "--served-model-name", "tiny"])
    body = {
        "model": "tiny",
        "prompt": "Hello",
        "max_tokens": 16,
        "temperature": 0,
        "ignore_eos": True,
    }

    async def main() -> list[str]:
        async with httpx.AsyncClient(timeout=60) as http:
            calls = [http.post(f"{s.url}/v1/completions", json=body) for s in (a, b) * 8]
            return [r.json()["choices"][0]["text"] for r in await asyncio.gather(*calls)]

    texts = asyncio.run(main())
    assert len(set(texts)) == 1 and texts[0]  # greedy: the same text through either server
    for server in (a, b):
        metrics = httpx.get(f"{server.url}/metrics").text
        assert (
            'vllm:request_success_total{engine="0",finished_reason="length",model_name="tiny"} 8.0'
            in metrics
        )
    stop_cleanly(a)
    r = httpx.post(f"{b.url}/v1/completions", json=body, timeout=60)
    assert r.json()["choices"][0]["text"] == texts[0]
