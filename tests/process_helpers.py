"""Helpers for tests that watch processes come and go."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Iterator

import psutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def python_env() -> dict[str, str]:
    """The environment for a Python subprocess that imports minivllm and tests from here."""
    return {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}


def spawned_children(pid: int) -> list[int]:
    """Direct children of `pid` started by multiprocessing's spawn (engine processes)."""
    try:
        children = psutil.Process(pid).children()
    except psutil.NoSuchProcess:
        return []
    found = []
    for child in children:
        try:
            if "spawn_main" in " ".join(child.cmdline()):
                found.append(child.pid)
        except psutil.Error:
            pass
    return found


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    """Wait until none of `pids` is alive (zombies count as gone); return those still alive."""
    deadline = time.monotonic() + timeout
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if _alive(p)]
        if alive:
            time.sleep(0.2)
    return alive


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def stream_until_killed(llm, kill, num_streams: int = 8, max_tokens: int = 3000):
    """Start `num_streams` greedy streams on an `AsyncLLM`, call `kill()` once one streams,
    and return what each caller ended with (None, or the exception it got) and how long
    after the kill the last one ended."""
    import asyncio

    import uvloop

    from minivllm import RequestOutputKind, SamplingParams

    params = SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )

    async def stream(i: int, started: asyncio.Event) -> BaseException | None:
        try:
            async for _ in llm.generate([1, 2, 3, i + 4], params, request_id=f"r{i}"):
                started.set()
        except BaseException as e:  # noqa: BLE001 - the test inspects what each caller got
            return e
        return None

    async def main():
        started = asyncio.Event()
        tasks = [asyncio.create_task(stream(i, started)) for i in range(num_streams)]
        await asyncio.wait_for(started.wait(), 60)
        killed_at = time.monotonic()
        kill()
        results = await asyncio.wait_for(asyncio.gather(*tasks), 30)
        return results, time.monotonic() - killed_at

    return uvloop.run(main())


LOG_LINE = re.compile(
    r"^(DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d \d\d:\d\d:\d\d \[[\w-]+ \d+\] [\w.]+: "
)


class Watched:
    """A command in a session of its own (so a signal can go to its whole process group),
    its output read as it comes, and every process that descends from it recorded while it
    runs: `survivors()` says which of them outlived it."""

    def __init__(self, cmd: list[str], env: dict[str, str], cwd: str | None = None) -> None:
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=cwd,
            start_new_session=True,
        )
        self.out: list[str] = []
        self.err: list[str] = []
        self.last_stdout_at = self.started
        self.exited_at: float | None = None
        self.descendants: set[int] = set()
        self._readers = [
            threading.Thread(target=self._read, args=(self.proc.stdout, self.out), daemon=True),
            threading.Thread(target=self._read, args=(self.proc.stderr, self.err), daemon=True),
            threading.Thread(target=self._watch, daemon=True),
        ]
        for t in self._readers:
            t.start()

    def _read(self, stream, into: list[str]) -> None:
        for line in iter(stream.readline, ""):
            into.append(line)
            if into is self.out:
                self.last_stdout_at = time.monotonic()

    def _watch(self) -> None:
        me = psutil.Process(self.proc.pid)
        while self.proc.poll() is None:
            with contextlib.suppress(psutil.Error):
                self.descendants.update(p.pid for p in me.children(recursive=True))
            time.sleep(0.05)

    @property
    def stdout(self) -> str:
        return "".join(self.out)

    @property
    def stderr(self) -> str:
        return "".join(self.err)

    def wait_for(self, text: str, timeout: float = 120.0) -> None:
        """Return once `text` is in its stdout or stderr; fail if it exits or times out first."""
        deadline = time.monotonic() + timeout
        while text not in self.stdout + self.stderr:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise AssertionError(f"never printed {text!r}:\n{self.stdout}\n{self.stderr}")
            time.sleep(0.05)

    def signal(self, signum: int, group: bool = False) -> float:
        """Send `signum` to the process (or its whole process group); when it was sent."""
        if group:
            os.killpg(self.proc.pid, signum)
        else:
            self.proc.send_signal(signum)
        return time.monotonic()

    def wait(self, timeout: float) -> int:
        """Its exit code; fail (killing what is left) if it runs past `timeout`."""
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(
                f"still running after {timeout} s:\n{self.stdout}\n{self.stderr}"
            ) from None
        self.exited_at = time.monotonic()
        for t in self._readers:
            t.join(10)
        return code

    def survivors(self, timeout: float = 10.0) -> list[int]:
        """Its descendants still alive `timeout` s from now (zombies count as gone)."""
        return wait_gone(sorted(self.descendants), timeout)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        for pid in self.descendants:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def python_script(path: str, source: str, *args: str) -> list[str]:
    """Write `source` to `path`; the command that runs it."""
    with open(path, "w") as f:
        f.write(textwrap.dedent(source))
    return [sys.executable, path, *args]


@contextlib.contextmanager
def private_tmpdir() -> Iterator[str]:
    """A short fresh directory to be a child's TMPDIR (ipc socket paths must stay short),
    removed afterwards; its run directories are checked in it."""
    path = tempfile.mkdtemp(prefix="mv-", dir="/tmp")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def wait_for_ipc_socket(address: str, timeout: float = 120.0) -> None:
    """Wait until a daemon starting at `address` (ipc://) has bound its socket: `connect`
    fails at once where no socket is."""
    path = address[len("ipc://") :]
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no socket at {path} after {timeout} s")
        time.sleep(0.1)
