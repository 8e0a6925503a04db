"""A `minivllm serve` process per test module: started on a free port, waited for through
/health, stopped with SIGTERM (its engine-core and workers with it)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import psutil
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def server_env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return {**env, **extra}


class ServerProcess:
    """`python -m minivllm.frontend.cli serve ARGS --port 0`, its log in `log_path`."""

    def __init__(self, args: list[str], log_path: str, env: dict[str, str] | None = None) -> None:
        self.log_path = log_path
        self.log = open(log_path, "w")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "minivllm.frontend.cli", "serve", *args, "--port", "0"],
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env=env or server_env(),
        )
        line = self.proc.stdout.readline()
        if "http://" not in line:
            self.stop()
            raise RuntimeError(f"the server did not start: {line!r}; log:\n{self.read_log()}")
        self.url = line.strip().rsplit(" ", 1)[-1]
        self.wait_healthy(timeout=120)

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)
        raise RuntimeError(f"the server never became healthy; log:\n{self.read_log()}")

    def children(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def read_log(self) -> str:
        self.log.flush()
        with open(self.log_path) as f:
            return f.read()

    def stop(self) -> None:
        children = self.children()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        _, alive = psutil.wait_procs(children, timeout=15)
        for p in alive:
            p.kill()
        self.log.close()
        assert not alive, f"processes outlived the server: {alive}"


@pytest.fixture(scope="module")
def server_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    """Start servers for this module; all are stopped at its end."""
    started: list[ServerProcess] = []

    def start(args: list[str], env: dict[str, str] | None = None) -> ServerProcess:
        log = tmp_path_factory.mktemp("server") / "server.log"
        server = ServerProcess(args, str(log), env)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()
