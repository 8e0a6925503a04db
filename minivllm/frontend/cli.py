"""`minivllm` command line: the engine-core daemon and its keys, the server, the benchmarks."""

from __future__ import annotations

import argparse
import os
import signal
import sys


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="minivllm", description="mini-vllm inference engine")
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_engine_core(sub)
    _add_keygen(sub)
    from minivllm.benchmarks import add_bench_parser
    from minivllm.frontend.server.serve import add_serve_parser

    add_serve_parser(sub)
    add_bench_parser(sub)
    args = parser.parse_args(argv)
    try:
        args.func(args)
    except KeyboardInterrupt:  # what was started stops as the interpreter exits
        print(f"minivllm {args.command}: interrupted", file=sys.stderr)
        raise SystemExit(128 + signal.SIGINT) from None


def version() -> str:
    """The installed package's version."""
    from importlib import metadata

    try:
        return metadata.version("minivllm")
    except metadata.PackageNotFoundError:
        return "unknown"


def _add_engine_core(sub: argparse._SubParsersAction) -> None:
    from minivllm.frontend.arg_utils import HelpFormatter, add_engine_args

    p = sub.add_parser(
        "engine-core",
        help="run an engine-core daemon that any number of clients attach to",
        description="Run an engine-core until SIGTERM. Clients attach with "
        "AsyncLLM.connect(ADDRESS) or LLM.connect(ADDRESS); they need no copy of the model: "
        "its tokenizer, limits and sampling defaults travel in the handshake.",
        formatter_class=HelpFormatter,
    )
    p.add_argument(
        "--address",
        help="input address: ipc:///path or tcp://HOST:PORT (default: an ipc socket in a "
        "private directory; tcp binds 127.0.0.1 unless a host is given)",
    )
    p.add_argument(
        "--curve-secret-key",
        metavar="FILE",
        help="this engine-core's CURVE secret key (NAME.key_secret from `minivllm keygen`); "
        "needed, with --curve-clients, to listen on a tcp address other than loopback",
    )
    p.add_argument(
        "--curve-clients",
        metavar="DIR",
        help="directory of the public keys (*.key) of the clients allowed to connect",
    )
    add_engine_args(p)
    p.set_defaults(func=_run_engine_core)


def _add_keygen(sub: argparse._SubParsersAction) -> None:
    from minivllm.frontend.arg_utils import HelpFormatter

    p = sub.add_parser(
        "keygen",
        help="make a CURVE key pair for an engine-core or one of its clients",
        description="Write DIR/NAME.key (the public key: give it to the peer) and "
        "DIR/NAME.key_secret (mode 600: keep it).",
        formatter_class=HelpFormatter,
    )
    p.add_argument("dir", help="directory for the key files (made with mode 700 if missing)")
    p.add_argument("--name", default="server", help="file name of the pair")
    p.set_defaults(func=_run_keygen)


def _run_keygen(args: argparse.Namespace) -> None:
    from minivllm.protocol.auth import generate_keys

    public, secret = generate_keys(args.dir, args.name)
    print(f"public key: {public}\nsecret key: {secret}")


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
    from minivllm.config import EngineArgs
    from minivllm.engine_core.core_process import run_engine_core
    from minivllm.frontend import handshake_model
    from minivllm.frontend.arg_utils import absolute_paths, engine_args_from
    from minivllm.logging_utils import configure_process_logging
    from minivllm.protocol import transport
    from minivllm.protocol.auth import CurveServerKeys, check_listen_address

    configure_process_logging("engine-core")
    input_address, output_address, ipc_dir = daemon_addresses(args.address)
    try:
        curve = None
        if args.curve_secret_key or args.curve_clients:
            if not (args.curve_secret_key and args.curve_clients):
                raise ValueError("--curve-secret-key and --curve-clients go together")
            curve = CurveServerKeys.load(args.curve_secret_key, args.curve_clients)
        for address in (input_address, output_address):
            check_listen_address(address, curve)
        if args.data_parallel_restart:
            raise ValueError(
                "--data-parallel-restart is for a frontend that starts its engine-cores; "
                "a daemon is restarted by whatever runs it"
            )
        # its clients run in other directories, or on other hosts
        config = engine_args_from(args, **absolute_paths(args)).create_engine_config()
        parallel = config.parallel
        if parallel.data_parallel_size > 1:
            raise ValueError(
                "a daemon is one engine-core; for data parallelism start one per rank and "
                "attach with AsyncLLM.connect([ADDRESS, ...]) or serve --connect A,B"
            )
        if parallel.data_parallel_failover_limit != EngineArgs.data_parallel_failover_limit:
            raise ValueError(
                "--data-parallel-failover-limit is for the client that routes over daemons "
                "(serve --connect A,B, or connect(..., data_parallel_failover_limit=N))"
            )
    except ValueError as e:
        if ipc_dir is not None:
            transport.cleanup_ipc(ipc_dir)
        raise SystemExit(f"minivllm engine-core: {e}") from None
    print(f"engine-core address: {input_address}", flush=True)
    try:
        run_engine_core(
            config,
            input_address,
            output_address,
            daemon=True,
            curve=curve,
            tokenizer_files=handshake_model.tokenizer_files(config.model),  # for its clients
        )
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
