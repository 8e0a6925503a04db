"""`minivllm serve MODEL [engine args]` or `minivllm serve --connect ADDRESS`: the
OpenAI-compatible server on uvicorn (uvloop, httptools).

With `--connect` it is one more client of a running `minivllm engine-core` daemon; any
number of API processes may attach to one daemon, each with its own port.
`--api-server-count N` serves one port from N processes over the same engine-cores
(api_servers.py).
"""

from __future__ import annotations

import argparse
import codecs
import logging
import sys
from typing import TYPE_CHECKING

from minivllm import envs
from minivllm.frontend.server.listen import bind_listeners
from minivllm.logging_utils import configure_process_logging
from minivllm.process_utils import freeze_startup_heap

if TYPE_CHECKING:
    from minivllm.config import EngineConfig

logger = logging.getLogger(__name__)


UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
_JINJA_CHARS = "{}\n"  # vLLM: a --chat-template without any of these is a file's path


def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    from minivllm.frontend.arg_utils import HelpFormatter, add_engine_args

    p = sub.add_parser(
        "serve",
        help="run the OpenAI-compatible HTTP server",
        description=__doc__,
        formatter_class=HelpFormatter,
    )
    p.add_argument("model_tag", nargs="?", default=None, help="model directory (or --model)")
    p.add_argument(
        "--host",
        default=None,
        help="address to listen on (default: all interfaces, as vLLM; 127.0.0.1 keeps the "
        "server to this machine)",
    )
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed)")
    p.add_argument(
        "--api-server-count",
        "-asc",
        type=int,
        default=1,
        help="API processes serving the port, each a client of the same engine-cores: more "
        "requests and tokens per second than one process's event loop can handle",
    )
    p.add_argument(
        "--api-key",
        default=envs.api_key(),
        help="clients must send `Authorization: Bearer KEY` (default: MINIVLLM_API_KEY, else none)",
    )
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="names the model answers to; the first is reported (default: the model path)",
    )
    p.add_argument(
        "--chat-template",
        default=None,
        help="a Jinja chat template: a file, or the template itself (text with {, } or a "
        "newline); default: the tokenizer's",
    )
    _add_connect_args(p)
    p.add_argument(
        "--disable-log-stats",
        action="store_true",
        help="no periodic stats line and no engine metrics on /metrics",
    )
    p.add_argument(
        "--enable-log-requests",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="log each request's id and sampling params (at DEBUG also its prompt ids)",
    )
    p.add_argument(
        "--disable-log-requests",
        dest="enable_log_requests",
        action="store_false",
        default=argparse.SUPPRESS,
        help="vLLM's older spelling of --no-enable-log-requests",
    )
    p.add_argument(
        "--max-log-len",
        type=int,
        default=None,
        help="prompt ids logged per request at most (default: all)",
    )
    p.add_argument(
        "--disable-uvicorn-access-log", action="store_true", help="no line per HTTP request"
    )
    p.add_argument(
        "--uvicorn-log-level", default="info", choices=UVICORN_LOG_LEVELS, help="uvicorn's"
    )
    add_engine_args(p, model_required=False)
    p.set_defaults(func=run_server)


def _add_connect_args(p: argparse.ArgumentParser) -> None:
    """The arguments of a server that attaches to daemons instead of starting an engine."""
    p.add_argument(
        "--connect",
        default=None,
        metavar="ADDRESS[,ADDRESS...]",
        help="attach to a daemon (several: requests routed over them) instead of starting "
        "an engine; the model's files are not needed here",
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


def load_chat_template(value: str | None) -> str | None:
    """vLLM's rule: a file's contents; a value that cannot be opened is the template itself
    if it has a Jinja character ({, } or a newline), else a path that failed (ValueError)."""
    if value is None:
        return None
    try:
        with open(value) as f:
            return f.read()
    except OSError as e:
        if not any(c in value for c in _JINJA_CHARS):
            raise ValueError(
                f"--chat-template: {value!r} looks like a file path, but it failed to be "
                f"opened: {e.strerror or e}"
            ) from None
    return codecs.decode(value, "unicode_escape")  # as vLLM: "\\n" in a shell is a newline


def _warn_if_open(host: str, api_key: str | None) -> None:
    """A server any host can reach, with no key, serves anyone: say so at start-up."""
    if api_key is None and host not in ("127.0.0.1", "localhost", "::1"):
        where = f"on {host}" if host else "on all interfaces (no --host)"
        logger.warning(
            "minivllm serve listens %s with no --api-key: anyone who can reach this port can "
            "use the model. Pass --api-key KEY, or --host 127.0.0.1 to serve this machine only.",
            where,
        )


def build_state(
    args: argparse.Namespace,
    chat_template: str | None = None,
    client_index: int = 0,
    metrics_dir: str | None = None,
):
    """The engine (spawned or attached) with its stat loggers, wrapped in a `ServerState`.
    As API process `client_index` of several: its metrics go to `metrics_dir`, shared with
    the others, and only the first logs the stats line (of all of them)."""
    from minivllm.frontend.async_llm import AsyncLLM
    from minivllm.frontend.clients.dp_client import make_client
    from minivllm.frontend.metrics.loggers import LoggingStatLogger
    from minivllm.frontend.metrics.prometheus import PrometheusStatLogger
    from minivllm.frontend.server.app import ServerState

    if args.connect:
        client, model_config, loaded, device = _attach(args)
        speculative = None  # the daemons': learnt from their stats
    else:
        config = engine_config_from(args)
        model_config, device = config.model, config.device.device
        client, loaded = make_client(config, asynchronous=True), None
        speculative = config.speculative
    names = args.served_model_name or [model_config.model]
    metrics = loggers = None
    if not args.disable_log_stats:
        failover = getattr(client, "failover", None)  # several engine-cores
        metrics = PrometheusStatLogger(
            names[0],
            model_config.max_model_len,
            num_speculative_tokens=0 if speculative is None else speculative.num_speculative_tokens,
            failover=None if failover is None else failover.stats,
            shared_dir=metrics_dir,
        )
        loggers = [metrics]
        if client_index == 0:
            totals = None if metrics_dir is None else metrics.token_totals
            label = "GPU" if device == "cuda" else device.upper()
            loggers.insert(0, LoggingStatLogger(label, totals=totals))
    engine = AsyncLLM(model_config, client, loggers, loaded, client_index)
    return ServerState(
        engine,
        names,
        chat_template,
        args.api_key,
        metrics,
        log_requests=args.enable_log_requests,
        max_log_len=args.max_log_len,
    )


def engine_config_from(args: argparse.Namespace) -> EngineConfig:
    """The engine's settings from `minivllm serve`'s flags; bad ones end the command with
    their message."""
    from minivllm.frontend.arg_utils import engine_args_from

    model = args.model_tag or args.model
    if not model:
        raise SystemExit("minivllm serve: name a model directory (or use --connect)")
    try:
        return engine_args_from(args, model=model).create_engine_config()
    except ValueError as e:
        raise SystemExit(f"minivllm serve: {e}") from None


def _attach(args: argparse.Namespace):
    """`--connect`: a client of the daemons, the model config and tokenizer they send (or
    `--tokenizer`'s), and this machine's device kind."""
    from minivllm.devices import cuda_device_count
    from minivllm.frontend.clients.dp_client import attach_client

    curve = None
    if args.curve_server_key or args.curve_secret_key:
        from minivllm.protocol.auth import CurveClientKeys

        try:
            curve = CurveClientKeys.load(args.curve_server_key, args.curve_secret_key)
        except (TypeError, ValueError) as e:
            raise SystemExit(f"minivllm serve: --curve-*: {e}") from None
    if args.data_parallel_restart:
        raise SystemExit(
            "minivllm serve: --data-parallel-restart restarts the engine-cores serve "
            "starts; with --connect, restart the daemons where they run"
        )
    # the daemon sends its model config and tokenizer, unless --tokenizer names one here
    tokenizer = args.tokenizer
    try:
        client = attach_client(
            args.connect.split(","),
            curve,
            asynchronous=True,
            has_tokenizer=bool(tokenizer),
            failover_limit=args.data_parallel_failover_limit,
        )
    except ValueError as e:
        raise SystemExit(f"minivllm serve: {e}") from None
    try:
        model_config, loaded = client.attached_model(tokenizer)
    except BaseException:
        client.shutdown()
        raise
    device = "cuda" if cuda_device_count() > 0 else "cpu"  # for the stats line's label
    return client, model_config, loaded, device


def run_server(args: argparse.Namespace) -> None:
    """Serve until SIGINT or SIGTERM. Whatever fails during the start stops what was
    started (the engine, once it is up) and exits non-zero with a line naming the cause."""
    configure_process_logging("api-server")
    if args.api_server_count < 1:
        raise SystemExit(
            f"minivllm serve: --api-server-count must be at least 1, got {args.api_server_count}"
        )
    try:
        chat_template = load_chat_template(args.chat_template)
    except ValueError as e:
        raise SystemExit(f"minivllm serve: {e}") from None
    # bound before anything starts, so a port in use fails fast and port 0 can be reported;
    # no --host binds every IPv4 interface, as vLLM does
    host = args.host or ""
    try:
        sockets = bind_listeners(host, args.port, args.api_server_count)
    except OSError as e:
        raise SystemExit(f"minivllm serve: cannot listen on {host}:{args.port}: {e}") from None
    _warn_if_open(host, args.api_key)
    shown = f"[{host}]" if ":" in host else host or "0.0.0.0"
    url = f"http://{shown}:{sockets[0].getsockname()[1]}"
    if args.api_server_count != 1:
        from minivllm.frontend.server.api_servers import serve_from_processes

        serve_from_processes(args, sockets, chat_template, url)
        sys.exit(0)
    (sock,) = sockets
    state = None
    try:
        try:
            state = build_state(args, chat_template)
            server = uvicorn_server(args, state)
        except Exception as e:
            logger.debug("start-up failed", exc_info=True)
            raise SystemExit(f"minivllm serve: could not start: {type(e).__name__}: {e}") from None
        print(f"minivllm serve: model {state.model_name!r} at {url}", flush=True)
        server.run(sockets=[sock])  # uvicorn's lifespan stops the engine when it ends
    finally:
        if state is not None:
            state.engine.shutdown()
    sys.exit(0)


def uvicorn_server(args: argparse.Namespace, state, server_class=None):
    """The uvicorn server of `state`'s app (`server_class`: a `uvicorn.Server` of another
    kind)."""
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
    return (server_class or uvicorn.Server)(config)
