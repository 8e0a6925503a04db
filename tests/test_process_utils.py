"""Private ipc directories: 0700, named after their process, stale ones swept."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import tempfile

from minivllm.process_utils import private_ipc_dir
from minivllm.protocol import transport


def test_stale_ipc_dirs_of_dead_processes_are_removed() -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = os.path.join(tempfile.gettempdir(), f"minivllm-workers-{dead.pid}-x1y2")
    os.makedirs(stale)
    open(os.path.join(stale, "results"), "w").close()
    live = os.path.join(tempfile.gettempdir(), f"minivllm-workers-{os.getpid()}-keep")
    os.makedirs(live, exist_ok=True)
    fresh = ""
    try:
        fresh = private_ipc_dir("workers")
        assert not os.path.exists(stale)
        assert os.path.isdir(live), "a live process's directory stays"
        assert os.path.basename(fresh).startswith(f"minivllm-workers-{os.getpid()}-")
        assert stat.S_IMODE(os.stat(fresh).st_mode) == 0o700
    finally:
        for path in (stale, live, fresh):
            if path:
                transport.cleanup_ipc(path)
