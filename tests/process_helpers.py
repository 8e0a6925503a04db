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
