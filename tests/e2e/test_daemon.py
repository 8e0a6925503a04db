"""An engine-core daemon serves clients that come and go; a dead client harms no one."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from minivllm import LLM, SamplingParams
from minivllm.frontend.clients.mp_client import SyncMPClient
from minivllm.protocol.messages import UtilityMethod
from tests.process_helpers import python_env, wait_for_ipc_socket

CLIENT = """
import asyncio, json, sys
import uvloop
from minivllm import AsyncLLM, RequestOutputKind, SamplingParams

async def main(address, n, max_tokens):
    llm = AsyncLLM.connect(address)
    first = asyncio.Event()

    async def one(i):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                                output_kind=RequestOutputKind.DELTA)
        count = 0
        async for out in llm.generate([1, 2, 3, i + 4], params, request_id=f"c{i}"):
            count += len(out.outputs[0].token_ids)
            if not first.is_set():
                first.set()
                print("streaming", flush=True)
        return count

    counts = await asyncio.gather(*[one(i) for i in range(n)])
    print(json.dumps(counts), flush=True)
    llm.shutdown()

uvloop.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))
"""


def start_client(address: str, n: int, max_tokens: int) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", CLIENT, address, str(n), str(max_tokens)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=python_env(),
    )


def wait_for_stats(address: str, predicate, timeout: float) -> dict:
    client = SyncMPClient.connect(address)
    try:
        deadline = time.monotonic() + timeout
        while True:
            stats = client.call_utility(UtilityMethod.STATS)
            if predicate(stats) or time.monotonic() > deadline:
                return stats
            time.sleep(0.2)
    finally:
        client.shutdown()


@pytest.fixture
def daemon(qwen3_dir: str, tmp_path):
    address = f"ipc://{tmp_path}/engine.sock"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "minivllm.frontend.cli",
            "engine-core",
            "--model",
            qwen3_dir,
            "--dtype",
            "float32",
            "--address",
            address,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=python_env(),
    )
    # connecting succeeds once the engine is up (the handshake waits for it)
    wait_for_ipc_socket(address)
    wait_for_stats(address, lambda s: True, timeout=5)
    yield address, proc
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def test_clients_come_and_go(daemon) -> None:
    address, proc = daemon
    doomed = start_client(address, n=4, max_tokens=400)
    assert doomed.stdout.readline().strip() == "streaming"
    survivor = start_client(address, n=4, max_tokens=40)
    doomed.send_signal(signal.SIGKILL)
    doomed.wait()

    out, _ = survivor.communicate(timeout=120)
    assert survivor.returncode == 0
    assert json.loads(out.strip().splitlines()[-1]) == [40] * 4

    # the dead client's requests are aborted and their KV blocks freed
    stats = wait_for_stats(address, lambda s: s["num_running"] == 0, timeout=20)
    assert stats["num_running"] == 0 and stats["kv_cache_usage"] == 0.0

    newcomer = start_client(address, n=2, max_tokens=10)
    out, _ = newcomer.communicate(timeout=120)
    assert json.loads(out.strip().splitlines()[-1]) == [10, 10]

    # the sync API attaches the same way, and detaching leaves the daemon up
    llm = LLM.connect(address)
    outs = llm.generate(
        [[1, 2, 3, 4]], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    )
    llm.shutdown()
    assert len(outs[0].outputs[0].token_ids) == 10
    assert proc.poll() is None, "the daemon outlives its clients"

    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=20) == 0
    assert not os.path.exists(address[len("ipc://") :])
