"""An engine-core daemon in a subprocess for end-to-end tests: its log in a file, its pids
and socket paths at hand, and the null model's tokens to check what it streams."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil

from minivllm import LLM, SamplingParams
from tests.process_helpers import spawned_children, wait_gone
from tests.tiny_models import VOCAB_SIZE

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def env(**extra: str) -> dict[str, str]:
    """This environment, with the repository on PYTHONPATH (plus `extra`)."""
    path = ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")
    return {**os.environ, "PYTHONPATH": path, **extra}


def null_tokens(prompt_len: int, n: int) -> list[int]:
    """What the null model generates after a prompt of `prompt_len` tokens."""
    return [((prompt_len - 1 + i) * 7919) % (VOCAB_SIZE - 16) + 16 for i in range(n)]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


class Daemon:
    """`minivllm engine-core` on `address`; the daemon's own process is the engine-core."""

    def __init__(self, model_dir: str, address: str, log_path: str, *args: str, **env_extra):
        self.address = address
        self.log_path = log_path
        self._log = open(log_path, "w")  # noqa: SIM115 - open as long as the daemon runs
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "minivllm.frontend.cli", "engine-core", "--model", model_dir]
            + ["--address", address, *args],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env(MINIVLLM_LOG_LEVEL="INFO", **env_extra),
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_listening(self, timeout: float = 120.0) -> None:
        """Return once the engine is up (its workers ready); raise if it exits first."""
        deadline = time.monotonic() + timeout
        while "engine-core listening" not in self.log():
            if self.proc.poll() is not None:
                raise RuntimeError(f"the daemon exited with {self.proc.returncode}:\n{self.log()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the daemon did not start:\n{self.log()}")
            time.sleep(0.2)

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def worker_pids(self) -> list[int]:
        return spawned_children(self.pid)

    def results_socket(self) -> str:
        """The ipc path of the engine-core's socket that its workers send results to."""
        for conn in psutil.Process(self.pid).net_connections(kind="unix"):
            if conn.laddr and os.path.basename(conn.laddr) == "results":
                return f"ipc://{conn.laddr}"
        raise LookupError("no results socket")

    def rss(self) -> dict[int, int]:
        """Resident bytes of the engine-core and of each worker."""
        return {
            pid: psutil.Process(pid).memory_info().rss for pid in [self.pid, *self.worker_pids()]
        }

    def canary(self, prompt_len: int = 5, max_tokens: int = 40) -> None:
        """A request through a fresh client must stream exactly the null model's tokens."""
        llm = LLM.connect(self.address)
        try:
            prompt = list(range(1, prompt_len + 1))
            out = llm.generate([prompt], greedy(max_tokens), use_tqdm=False)
        finally:
            llm.shutdown()
        assert list(out[0].outputs[0].token_ids) == null_tokens(prompt_len, max_tokens)

    def stop(self) -> None:
        """SIGTERM, and check that the daemon and its workers are gone."""
        workers = self.worker_pids() if self.proc.poll() is None else []
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        assert wait_gone(workers, timeout=15) == []
