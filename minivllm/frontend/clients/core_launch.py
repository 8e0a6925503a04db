"""An engine-core process that a frontend spawns, and the wait until it listens."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

import msgspec

from minivllm import envs
from minivllm.config import EngineConfig
from minivllm.exceptions import EngineStartupError
from minivllm.process_utils import (
    PROCESS_PRIORITY,
    describe_exit,
    on_release,
    private_ipc_dir,
    remove_run_dirs_of,
    spawn,
    terminate,
)
from minivllm.protocol import transport
from minivllm.protocol.messages import EngineCoreInfo


@dataclass
class EngineCoreLaunch:
    """A spawned engine-core that may still be starting. It is stopped by `cancel()`, or
    when nothing refers to this object any more, or at interpreter exit. Spawn from the main
    thread: a child's parent-death signal fires when the *thread* that spawned it ends."""

    proc: BaseProcess
    ready: Connection
    death_pipe: Connection
    ipc_dir: str
    _stop: Callable[[], None] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        args = (self.proc, self.ready, self.death_pipe, self.ipc_dir)
        self._stop = on_release(self, _stop_engine_core, *args, priority=PROCESS_PRIORITY)

    @classmethod
    def start(cls, config: EngineConfig) -> EngineCoreLaunch:
        from minivllm.engine_core.core_process import run_engine_core

        ipc_dir = private_ipc_dir("client")
        proc, ready, death = spawn(
            run_engine_core,
            dict(
                config=config,
                input_address=transport.ipc_address(ipc_dir, "input"),
                output_address=transport.ipc_address(ipc_dir, "output"),
                run_dir=ipc_dir,
            ),
            name="engine-core",
        )
        return cls(proc, ready, death, ipc_dir)

    def wait_ready(self) -> str:
        """Wait until the engine-core listens; its input address. `EngineStartupError`
        naming the cause if it fails to start."""
        proc, ready = self.proc, self.ready
        timeout_s = envs.startup_timeout_s()
        deadline = time.monotonic() + timeout_s
        while not ready.poll(0.2):
            if not proc.is_alive():
                raise EngineStartupError(f"{describe_exit(proc)} during startup")
            if time.monotonic() > deadline:
                raise EngineStartupError(f"engine-core did not start in {timeout_s:.0f} s")
        try:
            hello = msgspec.msgpack.decode(ready.recv_bytes(), type=EngineCoreInfo)
        except EOFError:
            proc.join(5)
            raise EngineStartupError(f"{describe_exit(proc)} during startup") from None
        finally:
            ready.close()
        if hello.error:
            proc.join(5)
            raise EngineStartupError(f"{hello.error} ({describe_exit(proc)})")
        return hello.input_address

    def request_stop(self) -> None:
        """Ask the engine-core to stop (SIGTERM) without waiting: several stop at once."""
        if self.proc.is_alive():
            self.proc.terminate()

    def cancel(self) -> None:
        """Stop the engine-core (SIGTERM: it stops its workers) and remove its run directory."""
        self._stop()


def _stop_engine_core(
    proc: BaseProcess, ready: Connection, death_pipe: Connection, ipc_dir: str
) -> None:
    terminate([proc], timeout=10.0)
    ready.close()
    death_pipe.close()
    transport.cleanup_ipc(ipc_dir)
    if not proc.is_alive():  # what an engine-core killed by a signal had no time to remove
        remove_run_dirs_of(proc.pid)
