"""Process lifecycle: children that die with their parent, and bounded shutdowns.

Every child gets two guards: `PR_SET_PDEATHSIG` (the kernel kills it when its parent dies)
and a death pipe (its read end reaches EOF when the parent dies, for platforms without
prctl and for a parent that exits without dying). Parents watch their children's sentinels.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import multiprocessing
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from minivllm.protocol import transport

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def die_with_parent(death_pipe: Connection | None) -> None:
    """Call first thing in a child: the kernel and a watcher thread both end us with the parent."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(Exception):
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if death_pipe is not None:

        def watch() -> None:
            with contextlib.suppress(Exception):
                death_pipe.recv_bytes()  # blocks until the parent's end closes
            os._exit(1)

        threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def spawn(
    target: Callable[..., Any], kwargs: dict[str, Any], name: str
) -> tuple[BaseProcess, Connection, Connection]:
    """Start `target(**kwargs, ready_pipe=..., death_pipe=...)` in a fresh (spawned) process.

    Returns the process, the read end of its ready pipe (the child reports its startup there)
    and the write end of its death pipe (keep it open while the child should live).
    """
    ctx = multiprocessing.get_context("spawn")
    ready_r, ready_w = ctx.Pipe(duplex=False)
    death_r, death_w = ctx.Pipe(duplex=False)
    proc = ctx.Process(
        target=target,
        kwargs={**kwargs, "ready_pipe": ready_w, "death_pipe": death_r},
        name=name,
        daemon=False,
    )
    proc.start()
    ready_w.close()
    death_r.close()
    return proc, ready_r, death_w


def terminate(procs: list[BaseProcess], timeout: float = 5.0) -> None:
    """SIGTERM, wait up to `timeout` in all, then SIGKILL what is left."""
    for p in procs:
        if p.is_alive():
            with contextlib.suppress(Exception):
                p.terminate()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            logger.warning("%s (pid %s) ignored SIGTERM; killing it", p.name, p.pid)
            with contextlib.suppress(Exception):
                p.kill()
            p.join(1.0)


def private_ipc_dir(role: str) -> str:
    """A fresh 0700 directory for this process's ipc sockets, named after its pid, after
    removing those left by processes of the same role that died without cleaning up
    (SIGKILL, or a parent's death taking them down)."""
    prefix = f"minivllm-{role}-"
    base = tempfile.gettempdir()
    with contextlib.suppress(OSError):
        for name in os.listdir(base):
            pid = name[len(prefix) :].split("-", 1)[0]
            if name.startswith(prefix) and pid.isdigit() and not _pid_alive(int(pid)):
                transport.cleanup_ipc(os.path.join(base, name))
    return transport.make_ipc_dir(f"{prefix}{os.getpid()}-")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def describe_exit(proc: BaseProcess) -> str:
    code = proc.exitcode
    if code is None:
        return f"{proc.name} (pid {proc.pid}) is running"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"{proc.name} (pid {proc.pid}) was killed by {signal.Signals(-code).name}"
    return f"{proc.name} (pid {proc.pid}) exited with code {code}"
