"""Start `minivllm serve` in a subprocess and wait until it answers: for benchmarks and tests.

The server binds its port itself (`--port 0` picks a free one) and prints its address
before starting the engine, so nothing probes for a free port and races to bind it. It
imports the minivllm this process runs (from a checkout as from an installed package).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import minivllm

# the directory that holds the minivllm package this process imported
_PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(minivllm.__file__)))


def _with_this_minivllm(env: dict[str, str] | None) -> dict[str, str]:
    env = dict(os.environ if env is None else env)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([_PACKAGE_PARENT, *paths])
    return env


class ServerProcess(contextlib.AbstractContextManager):
    """`python -m minivllm.frontend.cli serve ARGS --host HOST --port 0`; `url` is where it
    listens (HOST None: serve's default, all interfaces). Its stderr goes to `log_path` (or
    is discarded)."""

    def __init__(
        self,
        args: list[str],
        log_path: str | None = None,
        env: dict[str, str] | None = None,
        startup_timeout: float = 900.0,
        host: str | None = "127.0.0.1",
    ) -> None:
        self.log_path = log_path
        log = open(log_path, "w") if log_path else subprocess.DEVNULL  # noqa: SIM115
        host_args = [] if host is None else ["--host", host]
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "minivllm.frontend.cli",
                "serve",
                *args,
                *host_args,
                "--port",
                "0",
            ],
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            env=_with_this_minivllm(env),
        )
        if log_path:
            log.close()  # the child holds its own descriptor
        line = self.proc.stdout.readline()
        if "http://" not in line:
            self.stop()
            raise RuntimeError(f"minivllm serve did not start: {line!r}\n{self.read_log()}")
        # a server on every interface is reached here through loopback
        self.url = line.strip().rsplit(" ", 1)[-1].replace("//0.0.0.0:", "//127.0.0.1:")
        self.wait_healthy(startup_timeout)

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)
        raise RuntimeError(f"minivllm serve never became healthy\n{self.read_log()}")

    def read_log(self) -> str:
        if not self.log_path or not os.path.exists(self.log_path):
            return ""
        with open(self.log_path) as f:
            return f.read()

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM (the server shuts its engine down), SIGKILL after `timeout`."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        return self.proc.returncode

    def __exit__(self, *exc: object) -> None:
        self.stop()
