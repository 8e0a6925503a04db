"""Helpers for tests that watch processes come and go."""

from __future__ import annotations

import os
import time

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
