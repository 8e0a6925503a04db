"""A step that never returns: after execute_timeout the engine is declared dead with an
error naming the rank, every stream hears it, the workers' stacks are logged, and no
process is left behind. The first step, which compiles on a GPU, has no time limit."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from minivllm import LLM, EngineDeadError
from tests.e2e.daemon import Daemon, env, greedy
from tests.process_helpers import wait_gone
from tests.tiny_models import build_null_checkpoint

HARNESS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hang_harness.py")
TIMEOUT_S = 3.0


def test_a_hung_step_fails_the_engine_and_kills_the_workers(tmp_path) -> None:
    model = build_null_checkpoint(str(tmp_path / "null"))
    proc = subprocess.run(
        [sys.executable, HARNESS, model, str(TIMEOUT_S)],
        capture_output=True,
        text=True,
        timeout=240,
        env=env(HANG_AT="250", SLOW_FIRST_S=str(2 * TIMEOUT_S)),
    )
    lines = proc.stdout.strip().splitlines()
    assert proc.returncode == 0 and len(lines) == 2, proc.stdout + proc.stderr[-3000:]
    pids, outcome = json.loads(lines[0]), json.loads(lines[1])
    # the slow first step was waited for; the hang at step 250 was not
    assert outcome["first"] == "finished with 200 tokens"
    for result in outcome["results"]:
        assert result.startswith("EngineDeadError"), result
        assert "worker rank 0 (pid" in result and "execute_timeout (3 s)" in result, result
    assert outcome["elapsed"] < 2 * TIMEOUT_S + TIMEOUT_S + 60
    assert "in hanging" in proc.stderr, "the hung worker's stack is logged"
    assert wait_gone([pids["core"], *pids["workers"]], timeout=15) == []


def test_a_worker_that_dies_while_idle_is_noticed_by_the_next_request(tmp_path) -> None:
    # the step socket then has no peer, and a send to it used to wait for good
    model = build_null_checkpoint(str(tmp_path / "null"))
    daemon = Daemon(model, f"ipc://{tmp_path}/engine", str(tmp_path / "daemon.log"))
    try:
        daemon.wait_listening()
        daemon.canary()
        os.kill(daemon.worker_pids()[0], signal.SIGKILL)
        time.sleep(1.0)
        llm = LLM.connect(daemon.address)
        start = time.monotonic()
        with pytest.raises(
            EngineDeadError, match=r"worker-rank0 \(pid \d+\) was killed by SIGKILL"
        ):
            llm.generate([[1, 2, 3]], greedy(5), use_tqdm=False)
        assert time.monotonic() - start < 10
        llm.shutdown()
        assert daemon.proc.wait(timeout=30) == 1
    finally:
        daemon.stop()
