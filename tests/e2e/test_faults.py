"""Deaths: every waiting caller hears of a dead engine in seconds, and no process is left
behind. (Garbage on the sockets: test_fuzz_engine_core.py and test_fuzz_worker.py.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

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
