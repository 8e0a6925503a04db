"""Process lifecycle: children that die with their parent, owners that stop what they
started, run directories that go with their process, and bounded shutdowns.

Every child gets two guards: `PR_SET_PDEATHSIG` (the kernel signals it when its parent
dies) and a death pipe (its read end reaches EOF when the parent dies, for platforms without
prctl and for a parent that exits without dying). Parents watch their children's sentinels.
Children start with SIGINT ignored: a terminal's Ctrl-C reaches the whole process group,
and the process that owns a child decides when it stops (a child that wants SIGINT, a
daemon, installs its own handler).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import importlib
import logging
import multiprocessing
import multiprocessing.util
import os
import re
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from minivllm.model_registry import ModelRegistry
from minivllm.protocol import transport

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def die_with_parent(
    death_pipe: Connection | None, signum: int = signal.SIGKILL, grace_s: float = 10.0
) -> None:
    """Call first thing in a child: the kernel and a watcher thread both send us `signum`
    when the parent dies. A catchable `signum` (SIGTERM) lets the child clean up what a
    parent killed by SIGKILL could not; `grace_s` after it the watcher ends the process."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(Exception):
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signum)
    if death_pipe is not None:

        def watch() -> None:
            with contextlib.suppress(Exception):
                death_pipe.recv_bytes()  # blocks until the parent's end closes
            os.kill(os.getpid(), signum)
            time.sleep(grace_s)
            os._exit(1)

        threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def spawn(
    target: Callable[..., Any] | str, kwargs: dict[str, Any], name: str
) -> tuple[BaseProcess, Connection, Connection]:
    """Start `target(**kwargs, ready_pipe=..., death_pipe=...)` in a fresh (spawned) process,
    which starts with this process's model registrations (`ModelRegistry`: a spawned process
    shares none of this one's memory). A target named "module:function" is imported in the
    child only: the engine-core starts its workers without importing torch and the model
    code itself (seconds it would spend before the workers spend them again).

    Returns the process, the read end of its ready pipe (the child reports its startup there)
    and the write end of its death pipe (keep it open while the child should live).
    """
    ctx = multiprocessing.get_context("spawn")
    ready_r, ready_w = ctx.Pipe(duplex=False)
    death_r, death_w = ctx.Pipe(duplex=False)
    proc = ctx.Process(
        target=_start_child,
        args=(target, ModelRegistry.registered()),
        kwargs={**kwargs, "ready_pipe": ready_w, "death_pipe": death_r},
        name=name,
        daemon=False,
    )
    with _sigint_ignored():  # inherited: the child starts deaf to a terminal's Ctrl-C
        proc.start()
    ready_w.close()
    death_r.close()
    return proc, ready_r, death_w


def _start_child(
    target: Callable[..., Any] | str, models: dict[str, str], /, **kwargs: Any
) -> None:
    ModelRegistry.restore(models)
    if isinstance(target, str):
        module, _, function = target.partition(":")
        target = getattr(importlib.import_module(module), function)
    target(**kwargs)


@contextlib.contextmanager
def _sigint_ignored() -> Iterator[None]:
    """SIGINT ignored while a child starts: an ignored signal stays ignored across exec, and
    Python then installs no KeyboardInterrupt handler of its own. (A Ctrl-C in these few
    milliseconds is lost.) Only the main thread can change handlers: elsewhere, nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


# Exit priorities of `on_release`: an owner closes its clients before the processes behind
# them are stopped.
OWNER_PRIORITY = 20
PROCESS_PRIORITY = 10


def on_release(
    owner: object, callback: Callable[..., None], *args: Any, priority: int = OWNER_PRIORITY
) -> Callable[[], None]:
    """Arrange `callback(*args)` to run once: when the returned function is called, when
    `owner` is garbage-collected, or at interpreter exit, whichever comes first. The exit
    run comes before multiprocessing's own exit handler joins the children that are not
    daemons (an engine-core that nothing stopped would be waited for forever), higher
    priorities first. `callback` and `args` must not refer to `owner`, or it is never
    collected."""
    return multiprocessing.util.Finalize(owner, callback, args, exitpriority=priority)


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


_RUN_DIR = re.compile(r"minivllm-[a-z]+-(\d+)-")


def private_ipc_dir(role: str) -> str:
    """A fresh 0700 run directory for this process's ipc sockets, named after its role and
    pid, after removing those of processes that died without cleaning up (SIGKILL, or a
    parent's death taking them down)."""
    for path, pid in _run_dirs():
        if not _pid_alive(pid):
            transport.cleanup_ipc(path)
    return transport.make_ipc_dir(f"minivllm-{role}-{os.getpid()}-")


def remove_run_dirs_of(pid: int) -> None:
    """Remove the run directories of process `pid`, which has ended (a killed engine-core's
    workers directory, say)."""
    for path, owner in _run_dirs():
        if owner == pid:
            transport.cleanup_ipc(path)


def _run_dirs() -> list[tuple[str, int]]:
    """(path, pid of its process) of every run directory in the temporary directory."""
    base = tempfile.gettempdir()
    try:
        names = os.listdir(base)
    except OSError:
        return []
    return [
        (os.path.join(base, name), int(m.group(1)))
        for name in names
        if (m := _RUN_DIR.match(name)) is not None
    ]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def freeze_startup_heap() -> None:
    """Collect once, then keep what survived out of every later collection: a full one over
    the start-up heap (torch, transformers, the tokenizer) takes ~100 ms, a stall of every
    stream. Process-wide, so only for processes the engine owns (engine-core, workers, the
    `minivllm` commands), never from inside the library in a caller's process."""
    gc.collect()
    gc.freeze()


def describe_exit(proc: BaseProcess) -> str:
    code = proc.exitcode
    if code is None:
        return f"{proc.name} (pid {proc.pid}) is running"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"{proc.name} (pid {proc.pid}) was killed by {signal.Signals(-code).name}"
    return f"{proc.name} (pid {proc.pid}) exited with code {code}"
