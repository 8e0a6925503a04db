"""Deaths and garbage: every waiting caller hears of a dead engine in seconds, no process
is left behind, and nothing sent to a socket is ever executed."""

from __future__ import annotations

import json
import os
import pickle
import random
import signal
import subprocess
import sys
import time

import psutil
import pytest
import uvloop
import zmq

from minivllm import AsyncLLM, EngineArgs, EngineDeadError, RequestOutputKind, SamplingParams
from tests.process_helpers import python_env, spawned_children, stream_until_killed, wait_gone
from tests.tiny_models import build_null_checkpoint


@pytest.fixture(scope="module")
def null_dir(tmp_path_factory) -> str:
    return build_null_checkpoint(str(tmp_path_factory.mktemp("null")))


def _params(max_tokens: int) -> SamplingParams:
    return SamplingParams(
        temperature=0.0,
        max_tokens=max_tokens,
        ignore_eos=True,
        output_kind=RequestOutputKind.DELTA,
    )


def _run_and_kill(model_dir: str, kill) -> tuple[list, float, list[int]]:
    """Start 8 streams, then `kill(core_pid, worker_pid)`; return what each caller got, how
    long the last one waited after the kill, and the engine's pids."""
    llm = AsyncLLM.from_engine_args(EngineArgs(model=model_dir))
    core = spawned_children(os.getpid())[-1]
    worker = spawned_children(core)[0]
    try:
        results, waited = stream_until_killed(llm, lambda: kill(core, worker))
    finally:
        llm.shutdown()
    return results, waited, [core, worker]


@pytest.mark.parametrize("victim", ["engine-core", "worker"])
def test_sigkill_reaches_every_caller(null_dir: str, victim: str) -> None:
    def kill(core: int, worker: int) -> None:
        os.kill(core if victim == "engine-core" else worker, signal.SIGKILL)

    results, waited, pids = _run_and_kill(null_dir, kill)
    assert all(isinstance(r, EngineDeadError) for r in results), results
    assert waited < 5.0
    assert wait_gone(pids, timeout=15) == []


def test_exception_in_forward_reaches_every_caller(null_dir: str) -> None:
    script = os.path.join(os.path.dirname(__file__), "failing_forward.py")
    proc = subprocess.run(
        [sys.executable, script, null_dir],
        capture_output=True,
        text=True,
        env=python_env(),
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert all(r.startswith("EngineDeadError") for r in got["results"]), got["results"]
    assert "injected failure at position 200" in got["results"][0]
    assert len(got["pids"]) == 2  # the engine-core and its worker
    assert wait_gone(got["pids"], timeout=15) == []


class _Boom:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))  # unpickling this would create the file


def test_garbage_on_every_socket_is_dropped(null_dir: str, tmp_path) -> None:
    marker = tmp_path / "pwned"
    payloads = [pickle.dumps(_Boom(str(marker)), protocol=p) for p in (0, 2, 5)]
    rng = random.Random(0)
    payloads += [rng.randbytes(rng.randint(0, 300)) for _ in range(40)]
    payloads += [b"R" + p for p in payloads[:3]]  # a valid tag before a pickle

    llm = AsyncLLM.from_engine_args(EngineArgs(model=null_dir))
    core = spawned_children(os.getpid())[-1]

    async def generate(request_id: str) -> list[int]:
        outs = [o async for o in llm.generate("Hello", _params(20), request_id=request_id)]
        return [t for o in outs for t in o.outputs[0].token_ids]

    loop = uvloop.new_event_loop()
    try:
        before = loop.run_until_complete(generate("a"))
        sockets = [c.laddr for c in psutil.Process(core).net_connections(kind="unix") if c.laddr]
        sockets = sorted(
            {s for s in sockets if os.path.basename(s) in ("input", "output", "results")}
        )
        assert len(sockets) == 3, sockets
        ctx = zmq.Context()
        for path in sockets:
            kind = zmq.PUSH if path.endswith("results") else zmq.DEALER
            sock = ctx.socket(kind)
            sock.connect(f"ipc://{path}")
            for payload in payloads:
                sock.send_multipart([payload])
                sock.send_multipart([payload, payload])
            sock.close(linger=2000)
        ctx.term()
        time.sleep(1.0)
        after = loop.run_until_complete(generate("b"))
    finally:
        llm.shutdown()
        loop.close()
    assert not marker.exists()
    assert after == before, "the engine keeps serving, unharmed"
