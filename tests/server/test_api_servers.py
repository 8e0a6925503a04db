"""`minivllm serve --api-server-count N`: N API processes answer on one port over the same
engine-cores (here with `-dp 2`), `/metrics` in any of them counts all of them, killing one
fails only the requests it held, and whatever way the server ends, no process and no file
is left behind."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass

import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.process_helpers import LOG_LINE, Watched, private_tmpdir, python_env
from tests.tiny_models import build_null_checkpoint

CLI = [sys.executable, "-m", "minivllm.frontend.cli", "serve"]
START_S = 240  # four engine processes and two API processes on a shared machine
STOP_S = 20.0
LONG = 65536  # tokens: a stream that runs for a minute
CLIENT_TIMEOUT_S = 5  # the engine-cores abort a silent client's requests after this long


@dataclass
class Served:
    run: Watched
    port: int
    tmpdir: str

    def api_processes(self) -> list[psutil.Process]:
        """The children that listen on the port."""
        found = []
        for child in psutil.Process(self.run.proc.pid).children():
            try:
                if any(_listens(c, self.port) for c in child.net_connections("tcp")):
                    found.append(child)
            except psutil.Error:
                pass
        return found


def _listens(conn, port: int) -> bool:
    return conn.status == psutil.CONN_LISTEN and conn.laddr.port == port


def _start(args: list[str], tmpdir: str) -> Watched:
    env = {**python_env(), "TMPDIR": tmpdir, "MINIVLLM_LOG_LEVEL": "INFO"}
    env["MINIVLLM_CLIENT_TIMEOUT"] = str(CLIENT_TIMEOUT_S)
    return Watched([*CLI, *args, "--host", "127.0.0.1", "--port", "0"], env)


def _port(run: Watched) -> int:
    run.wait_for("minivllm serve: model", START_S)
    line = next(x for x in run.stdout.splitlines() if x.startswith("minivllm serve: model"))
    return int(line.rsplit(":", 1)[-1])


@pytest.fixture(scope="module")
def null_dir(tmp_path_factory) -> str:
    # room for streams that outlast the test
    return build_null_checkpoint(str(tmp_path_factory.mktemp("null")), max_position_embeddings=LONG)


@pytest.fixture(scope="module")
def served(null_dir: str):
    with private_tmpdir() as tmpdir:
        args = [null_dir, "-dp", "2", "--api-server-count", "2", "--disable-uvicorn-access-log"]
        run = _start(args, tmpdir)
        try:
            yield Served(run, _port(run), tmpdir)
        finally:
            run.kill()


class Request:
    """A completion on a connection of its own: `server_pid` is the API process that took
    it; with `stream`, `first` is its first event and `rest()` reads to the end."""

    def __init__(self, served: Served, max_tokens: int, stream: bool = False) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=60)
        body = {"prompt": [5, 6, 7], "max_tokens": max_tokens, "ignore_eos": True}
        if stream:
            body |= {"stream": True, "stream_options": {"include_usage": True}}
        self.conn.request("POST", "/v1/completions", json.dumps(body), _JSON)
        self.response = self.conn.getresponse()
        assert self.response.status == 200
        local_port = self.conn.sock.getsockname()[1]
        self.server_pid = _server_of(served, local_port)
        self.first = self.response.readline() if stream else b""
        self.body = b"" if stream else self.response.read()

    def rest(self) -> bytes | None:
        """The rest of the stream; None if it broke off."""
        try:
            return self.response.read()
        except (http.client.HTTPException, OSError):
            return None

    def close(self) -> None:
        self.conn.close()


_JSON = {"Content-Type": "application/json"}


def _server_of(served: Served, local_port: int) -> int:
    for p in served.api_processes():
        if any(c.raddr and c.raddr.port == local_port for c in p.net_connections("tcp")):
            return p.pid
    raise AssertionError(f"no API process holds the connection from port {local_port}")


def _requests_on_every_process(served: Served, max_tokens: int, stream: bool = False):
    """Requests on new connections until every API process took at least two."""
    pids = {p.pid for p in served.api_processes()}
    taken: list[Request] = []
    while not all(sum(r.server_pid == pid for r in taken) >= 2 for pid in pids):
        assert len(taken) < 60, "the kernel handed every connection to the same process"
        taken.append(Request(served, max_tokens, stream))
    return taken


def _metrics(served: Served) -> tuple[dict[tuple, float], int]:
    """/metrics on a new connection: {(name, labels): value}, and the process that answered."""
    conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=30)
    try:
        conn.request("GET", "/metrics")
        response = conn.getresponse()
        pid = _server_of(served, conn.sock.getsockname()[1])
        text = response.read().decode()
    finally:
        conn.close()
    samples = {
        (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    return samples, pid


GENERATED = ("vllm:generation_tokens_total", (("engine", "0"),))
LENGTH = ("vllm:request_success_total", (("engine", "0"), ("finished_reason", "length")))
RUNNING = ("vllm:num_requests_running", (("engine", "0"),))


def test_api_processes_answer_on_one_port(served: Served) -> None:
    api = served.api_processes()
    assert len(api) == 2
    requests = _requests_on_every_process(served, max_tokens=4)
    for r in requests:
        (choice,) = json.loads(r.body)["choices"]
        assert choice["finish_reason"] == "length"
        r.close()
    assert {r.server_pid for r in requests} == {p.pid for p in api}


def test_a_burst_of_connections_spreads_over_the_api_processes(served: Served) -> None:
    """Client pools opening their connections at once: each API process takes close to
    half (a socket shared by the processes split such bursts up to 2:1)."""
    n, threads = 512, 8
    conns: list[socket.socket] = []

    def open_some() -> None:
        mine = [
            socket.create_connection(("127.0.0.1", served.port), timeout=10)
            for _ in range(n // threads)
        ]
        conns.extend(mine)  # list.extend is atomic

    openers = [threading.Thread(target=open_some) for _ in range(threads)]
    try:
        for t in openers:
            t.start()
        for t in openers:
            t.join()
        ours = {c.getsockname()[1] for c in conns}
        deadline = time.monotonic() + 30
        while True:
            held = {
                p.pid: sum(1 for c in p.net_connections("tcp") if c.raddr and c.raddr.port in ours)
                for p in served.api_processes()
            }
            if sum(held.values()) == n or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert sum(held.values()) == n, held
        assert len(held) == 2 and min(held.values()) >= 0.4 * n, held
    finally:
        for c in conns:
            c.close()


def test_metrics_sum_across_processes(served: Served) -> None:
    before, _ = _metrics(served)
    requests = _requests_on_every_process(served, max_tokens=7)
    for r in requests:
        r.close()
    answered_by = set()
    for _ in range(60):  # every process reports every process's requests
        if len(answered_by) == 2:
            break
        after, pid = _metrics(served)
        answered_by.add(pid)
        assert after[LENGTH] - before[LENGTH] == len(requests)
        assert after[GENERATED] - before[GENERATED] == 7 * len(requests)
    assert len(answered_by) == 2
    assert after[RUNNING] == 0


def test_killing_one_api_process_fails_only_its_requests(served: Served) -> None:
    streams = _requests_on_every_process(served, max_tokens=LONG - 16, stream=True)
    victim = streams[0].server_pid
    os.kill(victim, signal.SIGKILL)
    for s in streams:
        if s.server_pid == victim:
            assert s.rest() is None  # cut off
        else:  # streams on
            events = [s.response.readline() for _ in range(400)]
            assert all(e.startswith(b"data: {") or e == b"\n" for e in events), events[-3:]
        s.close()  # the survivor aborts its requests as the client leaves
    survivors = [p.pid for p in served.api_processes()]
    assert victim not in survivors and len(survivors) == 1
    for _ in range(4):
        r = Request(served, max_tokens=3)
        assert r.server_pid == survivors[0]
        r.close()
    assert _get(served, "/health") == 200
    served.run.wait_for("was killed by SIGKILL; 1 of 2 API processes serve on", 30)
    # the engine-cores drop the dead process's requests once its heartbeats stop
    deadline = time.monotonic() + CLIENT_TIMEOUT_S + 20
    while _metrics(served)[0][RUNNING] > 0:
        assert time.monotonic() < deadline, "the killed process's requests still run"
        time.sleep(0.5)
    assert served.run.proc.poll() is None


def _get(served: Served, path: str) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=30)
    try:
        conn.request("GET", path)
        return conn.getresponse().status
    finally:
        conn.close()


def test_killed_serve_process_leaves_no_process_or_file(served: Served) -> None:
    assert len(served.run.descendants) >= 5  # 2 engine-cores, their workers, the API process
    served.run.signal(signal.SIGKILL)
    assert served.run.survivors(timeout=STOP_S) == []
    deadline = time.monotonic() + 5
    while os.listdir(served.tmpdir) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert os.listdir(served.tmpdir) == []


def test_one_ctrl_c_ends_every_process(null_dir: str) -> None:
    with private_tmpdir() as tmpdir:
        run = _start([null_dir, "--api-server-count", "2"], tmpdir)
        _port(run)
        run.wait_for("Application startup complete", START_S)
        time.sleep(0.5)
        sent = run.signal(signal.SIGINT, group=True)
        assert run.wait(30) == 128 + signal.SIGINT
        assert run.survivors(timeout=STOP_S) == []
        assert time.monotonic() - sent < STOP_S
        assert os.listdir(tmpdir) == []
    assert "Traceback" not in run.stderr, run.stderr
    assert run.stderr.strip().splitlines()[-1] == "minivllm serve: interrupted"
    logged = [line for line in run.stderr.splitlines() if not line.startswith("minivllm serve")]
    assert all(LOG_LINE.match(line) for line in logged), logged
    assert len(run.descendants) >= 4  # the engine-core, its worker, the API processes


def test_a_failed_start_ends_every_process(null_dir: str) -> None:
    """The API processes cannot attach (the engine-cores they are sent to are not there)."""
    with private_tmpdir() as tmpdir:
        run = _start(["--connect", "ipc:///no/such/engine", "--api-server-count", "2"], tmpdir)
        assert run.wait(START_S) == 1, run.stderr
        assert run.survivors(timeout=STOP_S) == []
        assert os.listdir(tmpdir) == []
        zero = _start([null_dir, "--api-server-count", "0"], tmpdir)
        assert zero.wait(60) == 1
        restart = _start([null_dir, "-dp", "2", "-asc", "2", "--data-parallel-restart"], tmpdir)
        assert restart.wait(60) == 1
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("minivllm serve: could not start: EngineStartupError: api-server-")
    assert "no engine-core at ipc:///no/such/engine" in last
    assert len(run.descendants) >= 2  # the API processes had started
    assert "--api-server-count must be at least 1, got 0" in zero.stderr
    assert not zero.descendants
    assert "--data-parallel-restart needs --api-server-count 1" in restart.stderr
    assert not restart.descendants


FAILOVER_COUNTERS = (
    "engine_core_deaths",
    "engine_core_requests_moved",
    "engine_core_requests_failed",
)


def test_a_killed_engine_core_moves_every_process_requests(null_dir: str) -> None:
    """Its own server: the engine-core dies under streams of both API processes; each moves
    its own requests to the other core, every stream ends whole, and either process's
    /metrics counts the death once (each process saw it) and the moves of both."""
    with private_tmpdir() as tmpdir:
        run = _start([null_dir, "-dp", "2", "--api-server-count", "2"], tmpdir)
        try:
            served = Served(run, _port(run), tmpdir)
            streams = _requests_on_every_process(served, max_tokens=3000, stream=True)
            api = {p.pid for p in served.api_processes()}
            cores = [
                c
                for c in psutil.Process(run.proc.pid).children()
                if c.pid not in api and "spawn_main" in " ".join(c.cmdline())
            ]
            assert len(cores) == 2
            cores[1].kill()
            for s in streams:
                body = s.first + (s.rest() or b"")
                events = [json.loads(e[6:]) for e in body.split(b"\n\n") if e[:7] == b"data: {"]
                assert events[-1]["usage"]["completion_tokens"] == 3000
                s.close()
            run.wait_for("the API processes move its requests", 30)
            by_process: dict[int, dict[str, float]] = {}
            for _ in range(60):  # until each process answered once
                if len(by_process) == 2:
                    break
                metrics, pid = _metrics(served)
                by_process[pid] = {
                    name: sum(v for (n, _), v in metrics.items() if n == f"vllm:{name}_total")
                    for name in FAILOVER_COUNTERS
                }
        finally:
            run.kill()
    assert len(by_process) == 2
    for counts in by_process.values():
        assert counts["engine_core_deaths"] == 1
        assert counts["engine_core_requests_failed"] == 0
    moved = {counts["engine_core_requests_moved"] for counts in by_process.values()}
    assert len(moved) == 1 and 1 <= moved.pop() <= len(streams)
