"""`minivllm serve --api-server-count N`: N API processes serve one port, each a client of
the same engine-cores, as vLLM's flag does.

    serve process      binds the port; starts the engine-cores (`-dp M`: M of them), or
                       knows the daemons (`--connect`); starts the API processes, watches
                       them, and stops them all
    API process x N    uvicorn on its own socket of the port (the kernel hashes each new
                       connection to one of them; listen.py) and an `AsyncLLM` attached
                       to every engine-core, as a daemon's client attaches
    engine-core x M    as under one API process; each API process is one more client

Each API process has its index (`client_index`), which keeps its internal request ids apart
from the others', and writes its metrics to a file of a directory they share, so that
`/metrics` in any of them is the sum of all (metrics/shared_values.py); only the first logs
the stats line, with every process's tokens. Each API process moves its own requests off an
engine-core that dies (failover, as one process does). An API process that dies fails only
its own requests: its connections close, the engine-cores abort its requests once its
heartbeats stop (`MINIVLLM_CLIENT_TIMEOUT`), and the others serve on. The serve process stops every
process it started on SIGTERM or one Ctrl-C (the API processes ignore SIGINT; the serve
process sends them SIGTERM), and exits non-zero once no API process is left; if it is
killed, its children stop on their own (parent-death signal) and the last run directories
go with them.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import multiprocessing
import os
import signal
import socket
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

import msgspec
import uvicorn

from minivllm import envs
from minivllm.config import EngineConfig
from minivllm.exceptions import EngineStartupError
from minivllm.frontend.clients.core_launch import EngineCoreLaunch
from minivllm.logging_utils import configure_process_logging
from minivllm.process_utils import (
    PROCESS_PRIORITY,
    describe_exit,
    die_with_parent,
    on_release,
    private_ipc_dir,
    spawn,
    terminate,
)
from minivllm.protocol import transport

logger = logging.getLogger(__name__)

API_STOP_TIMEOUT_S = 10.0  # uvicorn's graceful shutdown takes up to 5 s


class _Stopped(BaseException):
    """SIGTERM reached the serve process: unwinds whatever it is doing, as a Ctrl-C does."""


def _raise_stopped(_signum: int, _frame: Any) -> None:
    raise _Stopped


def serve_from_processes(
    args: argparse.Namespace,
    sockets: list[socket.socket],
    chat_template: str | None,
    url: str,
) -> None:
    """Serve the port of `sockets` (one per process, or one shared) from
    `args.api_server_count` processes until SIGTERM (returns) or
    SIGINT (KeyboardInterrupt); SystemExit naming the cause if the start fails or once
    every API process has ended. Everything started is stopped before it returns."""
    multiprocessing.current_process().name = "serve"
    group = APIServerGroup()
    previous = signal.signal(signal.SIGTERM, _raise_stopped)
    try:
        try:
            config = _launch_engines(args, group)
            # the API processes import while the engine-cores start
            group.start_servers(args, sockets, chat_template, args.api_server_count)
            for sock in sockets:
                sock.close()  # the API processes hold the listening sockets now
            group.attach(_client_settings(group, config))
            model = group.wait_ready()
        except (EngineStartupError, OSError, ValueError) as e:
            logger.debug("start-up failed", exc_info=True)
            raise SystemExit(f"minivllm serve: could not start: {type(e).__name__}: {e}") from None
        logger.info(
            "%d API processes serve %s over %d engine-core(s)",
            len(group.servers),
            url,
            len(group.launches) or len(args.connect.split(",")),
        )
        print(f"minivllm serve: model {model!r} at {url}", flush=True)
        group.watch()
        raise SystemExit("minivllm serve: every API process has ended")
    except _Stopped:
        pass
    finally:
        # one signal stops everything, and nothing interrupts the stop itself
        sigint = signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            group.stop()
        finally:
            signal.signal(signal.SIGINT, sigint)
            signal.signal(signal.SIGTERM, previous)


def _launch_engines(args: argparse.Namespace, group: APIServerGroup) -> EngineConfig | None:
    """Start the engine-cores (none with --connect) without waiting for them; their config."""
    if args.data_parallel_restart:
        raise SystemExit(
            "minivllm serve: --data-parallel-restart needs --api-server-count 1 (the API "
            "processes attach to the engine-cores as clients; none of them can restart one)"
        )
    if args.connect:
        return None
    from minivllm.frontend.clients.dp_placement import engine_configs
    from minivllm.frontend.server.serve import engine_config_from

    config = engine_config_from(args)
    for rank_config in engine_configs(config):  # their start-ups overlap
        group.launches.append(EngineCoreLaunch.start(rank_config))
    return config


def _client_settings(group: APIServerGroup, config: EngineConfig | None) -> dict[str, Any]:
    """What makes an API process a client of the engine-cores, once they listen: their
    addresses, and the tokenizer to load (a spawned engine-core sends none). Empty with
    --connect: the arguments say it all."""
    if config is None:
        return {}
    addresses = []
    for rank, launch in enumerate(group.launches):
        try:
            addresses.append(launch.wait_ready())
        except EngineStartupError as e:
            raise EngineStartupError(f"engine-core {rank} of {len(group.launches)}: {e}") from e
    model = config.model
    return {
        "connect": ",".join(addresses),
        "tokenizer": None if model.skip_tokenizer_init else model.tokenizer,
        "curve_server_key": None,  # private ipc sockets
        "curve_secret_key": None,
    }


class APIServerGroup:
    """The processes the serve process owns: the API processes, the engine-cores it
    started, and the metrics directory. They stop on `stop()`, or at interpreter exit."""

    def __init__(self) -> None:
        self.servers: list[BaseProcess] = []
        self.launches: list[EngineCoreLaunch] = []
        self.ready: list[Connection] = []
        self.go: list[Connection] = []
        self.pipes: list[Connection] = []  # every pipe end held here, closed at the stop
        self.dirs: list[str] = []
        self.stop = on_release(
            self,
            _stop_all,
            self.servers,
            self.launches,
            self.pipes,
            self.dirs,
            priority=PROCESS_PRIORITY,
        )

    def start_servers(
        self,
        args: argparse.Namespace,
        sockets: list[socket.socket],
        chat_template: str | None,
        count: int,
    ) -> None:
        """Spawn the API processes; each waits for `attach` before it connects."""
        metrics_dir = None
        if not args.disable_log_stats:
            metrics_dir = private_ipc_dir("metrics")
            self.dirs.append(metrics_dir)
        for index in range(count):
            go_r, go_w = multiprocessing.get_context("spawn").Pipe(duplex=False)
            kwargs = dict(
                args=args,
                chat_template=chat_template,
                sock=sockets[index % len(sockets)],
                index=index,
                metrics_dir=metrics_dir,
                go=go_r,
            )
            proc, ready, death = spawn(run_api_server, kwargs, name=f"api-server-{index}")
            go_r.close()
            self.servers.append(proc)
            self.ready.append(ready)
            self.go.append(go_w)
            self.pipes += [ready, death, go_w]

    def attach(self, settings: dict[str, Any]) -> None:
        """Let every API process attach, with `settings` over its arguments."""
        message = msgspec.msgpack.encode(settings)
        for go in self.go:
            go.send_bytes(message)

    def wait_ready(self) -> str:
        """Wait until every API process serves; the model's name. EngineStartupError naming
        the first that failed."""
        timeout_s = envs.startup_timeout_s()
        model = ""
        for proc, ready in zip(self.servers, self.ready, strict=True):
            if not wait([ready, proc.sentinel], timeout_s):
                raise EngineStartupError(f"{proc.name} did not start in {timeout_s:.0f} s")
            try:
                report = msgspec.msgpack.decode(ready.recv_bytes())
            except EOFError:
                proc.join(5)
                raise EngineStartupError(f"{describe_exit(proc)} during start-up") from None
            if report.get("error"):
                raise EngineStartupError(f"{proc.name}: {report['error']}")
            model = report["model"]
        return model

    def watch(self) -> None:
        """Until no API process is left: log each process that ends."""
        watched = {p.sentinel: p for p in self.servers}
        watched |= {launch.proc.sentinel: launch.proc for launch in self.launches}
        serving = len(self.servers)
        while serving:
            for sentinel in wait(list(watched)):
                proc = watched.pop(sentinel)
                proc.join(1.0)
                if proc in self.servers:
                    serving -= 1
                    logger.warning(
                        "%s; %d of %d API processes serve on",
                        describe_exit(proc),
                        serving,
                        len(self.servers),
                    )
                else:
                    logger.error(
                        "%s: the API processes move its requests to the other engine-cores "
                        "(up to --data-parallel-failover-limit) or fail them",
                        describe_exit(proc),
                    )


def _stop_all(
    servers: list[BaseProcess],
    launches: list[EngineCoreLaunch],
    pipes: list[Connection],
    dirs: list[str],
) -> None:
    """The API processes first (they end their streams), then the engine-cores."""
    for pipe in pipes:  # an API process still waiting to attach ends at once
        pipe.close()
    terminate(servers, timeout=API_STOP_TIMEOUT_S)
    for launch in launches:
        launch.request_stop()
    for launch in launches:
        launch.cancel()
    for path in dirs:
        transport.cleanup_ipc(path)


# ---------------------------------------------------------------------- the API process


class _APIServer(uvicorn.Server):
    """Stops on SIGTERM, the serve process's word; SIGINT stays ignored, as in every child
    (a terminal's Ctrl-C is the serve process's to handle)."""

    @contextlib.contextmanager
    def capture_signals(self):
        previous = signal.signal(signal.SIGTERM, self.handle_exit)
        try:
            yield
        finally:
            signal.signal(signal.SIGTERM, previous)


def run_api_server(
    args: argparse.Namespace,
    chat_template: str | None,
    sock: socket.socket,
    index: int,
    metrics_dir: str | None,
    go: Connection,
    ready_pipe: Connection,
    death_pipe: Connection,
) -> None:
    """An API process's entry point: import, wait for the engine-cores' addresses on `go`,
    attach, report on `ready_pipe`, serve `sock` until SIGTERM."""
    die_with_parent(death_pipe, signal.SIGTERM)
    signal.signal(signal.SIGTERM, _exit_on_signal)  # until uvicorn handles it
    configure_process_logging()
    parent = os.getppid()
    # the slow imports (transformers for the tokenizer, FastAPI) pass before the wait
    import minivllm.frontend.server.app  # noqa: F401
    from minivllm.frontend.server.serve import build_state, uvicorn_server

    if not getattr(args, "skip_tokenizer_init", False):
        from transformers import AutoTokenizer  # noqa: F401

    try:
        settings = msgspec.msgpack.decode(go.recv_bytes())
    except EOFError:  # the serve process gave up before the engine-cores started
        return
    finally:
        go.close()
    vars(args).update(settings)
    state = None
    try:
        try:
            state = build_state(args, chat_template, index, metrics_dir)
            server = uvicorn_server(args, state, _APIServer)
        except (Exception, SystemExit) as e:
            logger.debug("start-up failed", exc_info=True)
            cause = str(e) if isinstance(e, SystemExit) else f"{type(e).__name__}: {e}"
            _report(ready_pipe, {"error": cause})
            raise SystemExit(1) from None
        _report(ready_pipe, {"model": state.model_name})
        server.run(sockets=[sock])
    finally:
        if state is not None:
            state.engine.shutdown()
        if metrics_dir is not None and os.getppid() != parent:
            transport.cleanup_ipc(metrics_dir)  # the serve process was killed: no one else will


def _exit_on_signal(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)


def _report(ready_pipe: Connection, report: dict[str, str]) -> None:
    with contextlib.suppress(OSError):
        ready_pipe.send_bytes(msgspec.msgpack.encode(report))
    ready_pipe.close()
