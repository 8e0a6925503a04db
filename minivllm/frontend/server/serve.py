"""`minivllm serve MODEL [engine args]` or `minivllm serve --connect ADDRESS`: the
OpenAI-compatible server on uvicorn (uvloop, httptools).

With `--connect` it is one more client of a running `minivllm engine-core` daemon; any
number of API processes may attach to one daemon, each with its own port.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys

from minivllm import envs
from minivllm.logging_utils import configure_process_logging
from minivllm.process_utils import freeze_startup_heap

logger = logging.getLogger(__name__)


def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    from minivllm.frontend.arg_utils import add_engine_args

    p = sub.add_parser(
        "serve",
        help="run the OpenAI-compatible HTTP server",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model_tag", nargs="?", default=None, help="model directory (or --model)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed)")
    p.add_argument("--api-key", default=envs.api_key())
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="names the model answers to; the first is reported (default: the model path)",
    )
    p.add_argument("--chat-template", default=None, help="a Jinja chat template file")
    p.add_argument(
        "--connect",
        default=None,
        metavar="ADDRESS[,ADDRESS...]",
        help="attach to a daemon (several: requests routed over them)",
    )
    p.add_argument(
        "--curve-server-key",
        default=None,
        metavar="FILE",
        help="with --connect to daemons that ask for CURVE keys: their public key (NAME.key)",
    )
    p.add_argument(
        "--curve-secret-key",
        default=None,
        metavar="FILE",
        help="and this client's secret key (NAME.key_secret, from `minivllm keygen`)",
    )
    p.add_argument("--disable-log-stats", action="store_true")
    p.add_argument("--disable-uvicorn-access-log", action="store_true")
    p.add_argument("--uvicorn-log-level", default="info")
    add_engine_args(p, model_required=False)
    p.set_defaults(func=run_server)


def _chat_template(value: str | None) -> str | None:
    """A file's contents, or the value itself when it is not a file (an inline template)."""
    if value is None or not os.path.isfile(value):
        return value
    with open(value) as f:
        return f.read()


def build_state(args: argparse.Namespace):
    """The engine (spawned or attached) with its stat loggers, wrapped in a `ServerState`."""
    from minivllm.frontend.async_llm import AsyncLLM
    from minivllm.frontend.dp_client import attach_client, make_client
    from minivllm.frontend.metrics.loggers import LoggingStatLogger
    from minivllm.frontend.metrics.prometheus import PrometheusStatLogger
    from minivllm.frontend.server.app import ServerState

    if args.connect:
        import torch

        curve = None
        if args.curve_server_key or args.curve_secret_key:
            from minivllm.protocol.auth import CurveClientKeys

            try:
                curve = CurveClientKeys.load(args.curve_server_key, args.curve_secret_key)
            except (TypeError, ValueError) as e:
                raise SystemExit(f"minivllm serve: --curve-*: {e}") from None
        client = attach_client(args.connect.split(","), curve, asynchronous=True)
        model_config = client.engine_config().model
        device = "cuda" if torch.cuda.is_available() else "cpu"
    else:
        from minivllm.frontend.arg_utils import engine_args_from

        model = args.model_tag or args.model
        if not model:
            raise SystemExit("minivllm serve: name a model directory (or use --connect)")
        try:
            config = engine_args_from(args, model=model).create_engine_config()
        except ValueError as e:
            raise SystemExit(f"minivllm serve: {e}") from None
        model_config, device = config.model, config.device.device
        client = make_client(config, asynchronous=True)
    names = args.served_model_name or [model_config.model]
    metrics = loggers = None
    if not args.disable_log_stats:
        metrics = PrometheusStatLogger(names[0], model_config.max_model_len)
        loggers = [LoggingStatLogger("GPU" if device == "cuda" else device.upper()), metrics]
    engine = AsyncLLM(model_config, client, loggers)
    return ServerState(engine, names, _chat_template(args.chat_template), args.api_key, metrics)


def run_server(args: argparse.Namespace) -> None:
    """Serve until SIGINT or SIGTERM. Whatever fails during the start stops what was
    started (the engine, once it is up) and exits non-zero with a line naming the cause."""
    configure_process_logging("api-server")
    # bound before anything starts, so a port in use fails fast and port 0 can be reported
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))
    except OSError as e:
        raise SystemExit(f"minivllm serve: cannot listen on {args.host}:{args.port}: {e}") from None
    state = None
    try:
        try:
            state = build_state(args)
            server = _uvicorn_server(args, state)
        except Exception as e:
            logger.debug("start-up failed", exc_info=True)
            raise SystemExit(f"minivllm serve: could not start: {type(e).__name__}: {e}") from None
        port = sock.getsockname()[1]
        url = f"http://{args.host}:{port}"
        print(f"minivllm serve: model {state.model_name!r} at {url}", flush=True)
        server.run(sockets=[sock])  # uvicorn's lifespan stops the engine when it ends
    finally:
        if state is not None:
            state.engine.shutdown()
    sys.exit(0)


def _uvicorn_server(args: argparse.Namespace, state):
    import uvicorn

    from minivllm.frontend.server.app import build_app
    from minivllm.frontend.server.streaming import with_server_send

    freeze_startup_heap()  # the server's own process: later collections skip start-up's heap
    config = uvicorn.Config(
        with_server_send(build_app(state)),
        loop="uvloop",
        http="httptools",
        log_config=None,  # uvicorn's lines go through the root logger, in minivllm's format
        log_level=args.uvicorn_log_level,
        access_log=not args.disable_uvicorn_access_log,
        timeout_graceful_shutdown=5,
    )
    return uvicorn.Server(config)
