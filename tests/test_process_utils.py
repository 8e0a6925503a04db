"""Private ipc (run) directories: 0700, named after their process, those of dead processes
swept whatever their role; `on_release` runs its callback once, on the first of a call and
the owner's collection."""

from __future__ import annotations

import gc
import os
import stat
import subprocess
import sys
import tempfile

from minivllm.process_utils import on_release, private_ipc_dir, remove_run_dirs_of
from minivllm.protocol import transport
from tests.process_helpers import private_tmpdir


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


def test_run_dirs_of_any_role_go_with_their_process(monkeypatch) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    with private_tmpdir() as root:
        monkeypatch.setattr(tempfile, "tempdir", root)
        for role in ("client", "daemon"):
            os.makedirs(os.path.join(root, f"minivllm-{role}-{dead.pid}-ab12"))
        fresh = private_ipc_dir("workers")  # another role's start sweeps them
        assert os.listdir(root) == [os.path.basename(fresh)]
        os.makedirs(os.path.join(root, "minivllm-workers-4194304-cd34"))  # its pid ended
        os.makedirs(os.path.join(root, "minivllm-workers-41943040-ef56"))  # another pid
        remove_run_dirs_of(4194304)
        assert sorted(os.listdir(root)) == sorted(
            [os.path.basename(fresh), "minivllm-workers-41943040-ef56"]
        )


def test_on_release_runs_once_at_the_first_of_a_call_and_collection() -> None:
    class Owner:
        pass

    calls: list[str] = []
    owner = Owner()
    release = on_release(owner, calls.append, "released")
    del owner
    gc.collect()
    assert calls == ["released"]
    release()  # already run
    assert calls == ["released"]
    owner = Owner()
    release = on_release(owner, calls.append, "called")
    release()
    del owner
    gc.collect()
    assert calls == ["released", "called"]
