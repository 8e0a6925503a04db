"""A `minivllm serve` process per test module (`server_factory`), stopped with SIGTERM at
the module's end; its engine-core and workers must be gone with it."""

from __future__ import annotations

import os
from collections.abc import Iterator

import psutil
import pytest

from minivllm.frontend.server.launch import ServerProcess

# the server most tests share: the tiny Qwen3, two names, its own chat template, and the
# stats log line every second
MODEL = "tiny-qwen"
ALIAS = "alias"
CHAT_TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant]"
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def server_env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return {**env, **extra}


def descendants(server: ServerProcess) -> list[psutil.Process]:
    try:
        return psutil.Process(server.proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def stop_cleanly(server: ServerProcess) -> None:
    children = descendants(server)
    server.stop()
    _, alive = psutil.wait_procs(children, timeout=15)
    for p in alive:
        p.kill()
    assert not alive, f"processes outlived the server: {alive}"


@pytest.fixture(scope="module")
def server_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    """Start servers for this module; all are stopped at its end."""
    started: list[ServerProcess] = []

    def start(args: list[str], env: dict[str, str] | None = None) -> ServerProcess:
        log = tmp_path_factory.mktemp("server") / "server.log"
        server = ServerProcess(args, str(log), env or server_env(), startup_timeout=120)
        started.append(server)
        return server

    yield start
    for server in started:
        stop_cleanly(server)


@pytest.fixture(scope="session")
def api_server(qwen3_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """One server for the modules that only talk to it (its start-up is most of their time)."""
    root = tmp_path_factory.mktemp("api-server")
    template = root / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    args = [qwen3_dir, "--dtype", "float32", "--served-model-name", MODEL, ALIAS]
    args += ["--chat-template", str(template)]
    env = server_env(MINIVLLM_LOG_STATS_INTERVAL="1")
    server = ServerProcess(args, str(root / "server.log"), env, startup_timeout=120)
    yield server
    stop_cleanly(server)
