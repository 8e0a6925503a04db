"""minivllm's lines in a caller's process: in minivllm's format with a timestamp while the
application set up no logging; in the application's own format, once each, after it did."""

from __future__ import annotations

import subprocess
import sys

from tests.process_helpers import LOG_LINE, python_env

SCRIPT = """
import logging
import minivllm

log = logging.getLogger("minivllm.frontend.example")
log.info("before")
logging.basicConfig(format="app: %(message)s")
log.info("after")
logging.getLogger("other").warning("not ours")
"""


def test_library_lines_follow_the_application_logging() -> None:
    env = {**python_env(), "MINIVLLM_LOG_LEVEL": "INFO"}
    run = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=120
    )
    assert run.returncode == 0, run.stderr
    first, *rest = run.stderr.splitlines()
    assert LOG_LINE.match(first) and first.endswith("minivllm.frontend.example: before")
    assert "[MainProcess " in first
    assert rest == ["app: after", "app: not ours"]
