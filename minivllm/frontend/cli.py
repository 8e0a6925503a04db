"""`minivllm` command line: the engine-core daemon, the server and the benchmarks."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from minivllm import envs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="minivllm", description="mini-vllm inference engine")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_engine_core(sub)
    from minivllm.frontend.bench import add_bench_parser
    from minivllm.frontend.server.serve import add_serve_parser

    add_serve_parser(sub)
    add_bench_parser(sub)
    args = parser.parse_args(argv)
    args.func(args)


def _add_engine_core(sub: argparse._SubParsersAction) -> None:
    from minivllm.frontend.arg_utils import add_engine_args

    p = sub.add_parser(
        "engine-core",
        help="run an engine-core daemon that any number of clients attach to",
        description="Run an engine-core until SIGTERM. Clients attach with "
        "AsyncLLM.connect(ADDRESS) or LLM.connect(ADDRESS).",
    )
    p.add_argument(
        "--address",
        default=None,
        help="input address: ipc:///path or tcp://HOST:PORT (default: an ipc socket in a "
        "private directory; tcp binds 127.0.0.1 unless a host is given)",
    )
    add_engine_args(p)
    p.set_defaults(func=_run_engine_core)


def daemon_addresses(address: str | None) -> tuple[str, str, str | None]:
    """(input address, output address, private ipc dir to remove at exit or None)."""
    from minivllm.process_utils import private_ipc_dir
    from minivllm.protocol import transport

    if address is None:
        ipc_dir = private_ipc_dir("daemon")
        return (
            transport.ipc_address(ipc_dir, "input"),
            transport.ipc_address(ipc_dir, "output"),
            ipc_dir,
        )
    if address.startswith("ipc://"):
        return address, address + ".out", None
    if address.startswith("tcp://"):
        host = address[len("tcp://") :].rsplit(":", 1)[0]
        return address, f"tcp://{host}:0", None
    raise SystemExit(f"--address must start with ipc:// or tcp://, got {address!r}")


def _run_engine_core(args: argparse.Namespace) -> None:
    from minivllm.engine_core.core_process import run_engine_core
    from minivllm.frontend.arg_utils import engine_args_from
    from minivllm.protocol import transport

    logging.basicConfig(level=envs.log_level())
    try:
        config = engine_args_from(args).create_engine_config()
    except ValueError as e:
        raise SystemExit(f"minivllm engine-core: {e}") from None
    if config.parallel.data_parallel_size > 1:
        raise SystemExit(
            "minivllm engine-core: a daemon is one engine-core; for data parallelism start one "
            "per rank and attach with AsyncLLM.connect([ADDRESS, ...]) or serve --connect A,B"
        )
    input_address, output_address, ipc_dir = daemon_addresses(args.address)
    print(f"engine-core address: {input_address}", flush=True)
    try:
        run_engine_core(config, input_address, output_address, daemon=True)
    finally:
        if ipc_dir is not None:
            transport.cleanup_ipc(ipc_dir)
        elif input_address.startswith("ipc://"):
            for addr in (input_address, output_address):
                path = addr[len("ipc://") :]
                if os.path.exists(path):
                    os.unlink(path)


if __name__ == "__main__":
    sys.exit(main())
