"""An engine-core process that a frontend spawns, and the wait until it listens."""

from __future__ import annotations

import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

import msgspec

from minivllm import envs
from minivllm.config import EngineConfig
from minivllm.exceptions import EngineStartupError
from minivllm.process_utils import describe_exit, private_ipc_dir, spawn, terminate
from minivllm.protocol import transport
from minivllm.protocol.messages import EngineCoreInfo


@dataclass
class EngineCoreLaunch:
    """A spawned engine-core that may still be starting. Spawn from the main thread: a
    child's parent-death signal fires when the *thread* that spawned it ends."""

    proc: BaseProcess
    ready: Connection
    death_pipe: Connection
    ipc_dir: str

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

    def cancel(self) -> None:
        """Stop an engine-core that no client took over."""
        terminate([self.proc], timeout=10.0)
        self.ready.close()
        self.death_pipe.close()
        transport.cleanup_ipc(self.ipc_dir)
