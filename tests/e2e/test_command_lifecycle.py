"""`minivllm engine-core` and `minivllm serve` end on one Ctrl-C with one line, and a
`serve` whose start fails exits non-zero naming the cause: never a hang, never a process
or a run directory left behind."""

from __future__ import annotations

import os
import signal
import socket
import sys
import time

import psutil
import pytest

from tests.process_helpers import LOG_LINE, Watched, private_tmpdir, python_env
from tests.tiny_models import build_null_checkpoint

CLI = [sys.executable, "-m", "minivllm.frontend.cli"]
START_S = 120
STOP_S = 10.0  # after one SIGINT: everything gone (about 1 s on an idle machine)


@pytest.fixture(scope="module")
def null_dir(tmp_path_factory) -> str:
    return build_null_checkpoint(str(tmp_path_factory.mktemp("null")))


@pytest.fixture
def run_dir_root():
    with private_tmpdir() as path:
        yield path


def _start(args: list[str], tmpdir: str) -> Watched:
    return Watched([*CLI, *args], {**python_env(), "TMPDIR": tmpdir, "MINIVLLM_LOG_LEVEL": "INFO"})


def _interrupt(run: Watched, ready: str) -> tuple[int, float, list[str]]:
    """Once `ready` is printed, one SIGINT to the process group (a terminal's Ctrl-C): the
    exit code, the seconds until every process ended, and the lines printed after it."""
    run.wait_for(ready, START_S)
    time.sleep(0.5)
    printed = len((run.stdout + run.stderr).splitlines())
    sent = run.signal(signal.SIGINT, group=True)
    code = run.wait(30)
    assert run.survivors(timeout=STOP_S) == []
    took = time.monotonic() - sent
    after = (run.stdout + run.stderr).splitlines()[printed:]
    return code, took, after


def test_engine_core_daemon_ends_on_one_sigint(null_dir: str, run_dir_root: str) -> None:
    run = _start(["engine-core", "--model", null_dir], run_dir_root)
    code, took, after = _interrupt(run, "engine-core listening")
    assert code == 128 + signal.SIGINT
    assert took < STOP_S
    assert len(after) == 1 and after[0].endswith("engine-core stopped by SIGINT"), after
    assert LOG_LINE.match(after[0])
    assert len(run.descendants) >= 1  # its worker
    assert os.listdir(run_dir_root) == []


def test_serve_ends_on_one_sigint(null_dir: str, run_dir_root: str) -> None:
    run = _start(["serve", null_dir, "--port", "0"], run_dir_root)
    code, took, after = _interrupt(run, "Application startup complete")
    assert code == 128 + signal.SIGINT
    assert took < STOP_S
    assert "Traceback" not in run.stderr, run.stderr
    assert after[-1] == "minivllm serve: interrupted"
    # uvicorn's lines, the engine's and the server's: one format, with timestamps
    logged = [line for line in run.stderr.splitlines() if not line.startswith("minivllm serve")]
    assert all(LOG_LINE.match(line) for line in logged), logged
    assert len(run.descendants) >= 2  # the engine-core and its worker
    assert os.listdir(run_dir_root) == []


def test_serve_ends_on_one_sigint_while_its_engine_starts(null_dir: str, run_dir_root: str) -> None:
    """The Ctrl-C lands while the engine-core's worker is still starting: no process but
    the server's own reports it, and none is left."""
    run = _start(["serve", null_dir, "--port", "0"], run_dir_root)
    deadline = time.monotonic() + START_S
    while _spawned_depth(run.proc.pid) < 2:
        assert run.proc.poll() is None and time.monotonic() < deadline, run.stderr
        time.sleep(0.05)
    sent = run.signal(signal.SIGINT, group=True)
    assert run.wait(30) == 128 + signal.SIGINT
    assert run.survivors(timeout=STOP_S) == []
    assert time.monotonic() - sent < STOP_S
    assert "engine-core listening" not in run.stderr, "the engine had started: not tested"
    assert "Traceback" not in run.stderr, run.stderr
    assert run.stderr.strip().splitlines()[-1] == "minivllm serve: interrupted"
    assert os.listdir(run_dir_root) == []


def _spawned_depth(pid: int) -> int:
    """How many generations of spawned processes run below `pid`: 1 once its engine-core
    started, 2 once that one's worker did."""
    depth, parents = 0, [pid]
    try:
        while True:
            children = [
                c.pid
                for p in parents
                for c in psutil.Process(p).children()
                if "spawn_main" in " ".join(c.cmdline())
            ]
            if not children:
                return depth
            depth, parents = depth + 1, children
    except psutil.Error:
        return depth


def _failed_start(args: list[str], tmpdir: str) -> Watched:
    run = _start(["serve", *args, "--port", "0"], tmpdir)
    assert run.wait(START_S) == 1, run.stderr
    assert run.survivors() == []
    assert os.listdir(tmpdir) == []
    return run


def test_serve_fails_fast_naming_the_cause(null_dir: str, run_dir_root: str) -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        run = _start(["serve", null_dir, "--host", "127.0.0.1", "--port", str(port)], run_dir_root)
        assert run.wait(START_S) == 1
    finally:
        taken.close()
    assert f"cannot listen on 127.0.0.1:{port}" in run.stderr
    assert not run.descendants  # refused before any engine started

    run = _failed_start(["--connect", "ipc:///no/such/socket"], run_dir_root)
    assert "no engine-core at ipc:///no/such/socket" in run.stderr


def test_serve_start_failure_after_the_engine_started_stops_it(tmp_path, run_dir_root: str) -> None:
    """The engine starts (it needs no tokenizer), then the server cannot load one."""
    model = build_null_checkpoint(str(tmp_path / "model"))
    with open(os.path.join(model, "tokenizer.json"), "w") as f:
        f.write("not json")
    run = _failed_start([model], run_dir_root)
    assert "engine-core listening" in run.stderr  # the engine was up
    assert len(run.descendants) >= 2
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("minivllm serve: could not start:")
    assert f"tokenizer: cannot load one from {model!r}: Expecting value" in last
    assert "Traceback" not in run.stderr, run.stderr
