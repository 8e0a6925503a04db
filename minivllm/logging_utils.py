"""One log line format in every process (frontend, server, engine-core, workers):

    INFO 11-27 14:22:36 [engine-core 5865] minivllm.engine_core.engine_core: engine core ready

Processes the engine owns (engine-core, workers, the `minivllm` commands) configure the
root logger with it (`configure_process_logging`). In a caller's process the library
touches only its own logger: a handler that prints minivllm's lines in this format while the
process has no logging set up of its own, and steps aside once the root logger has a
handler (the application's format then applies, and nothing is printed twice).
"""

from __future__ import annotations

import logging

from minivllm import envs

FORMAT = "%(levelname)s %(asctime)s [%(processName)s %(process)d] %(name)s: %(message)s"
DATE_FORMAT = "%m-%d %H:%M:%S"


def formatter() -> logging.Formatter:
    return logging.Formatter(FORMAT, DATE_FORMAT)


def configure_process_logging(process_name: str | None = None) -> None:
    """Log every logger's lines in minivllm's format at `MINIVLLM_LOG_LEVEL`, in a process
    the engine owns; `process_name` names it in each line (spawned children are named by
    multiprocessing already). Leaves a root logger that already has handlers alone."""
    if process_name is not None:
        import multiprocessing

        multiprocessing.current_process().name = process_name
    logging.basicConfig(level=envs.log_level(), format=FORMAT, datefmt=DATE_FORMAT)


class _UnlessConfigured(logging.StreamHandler):
    """stderr, in minivllm's format, only while the root logger has no handler."""

    def emit(self, record: logging.LogRecord) -> None:
        if not logging.getLogger().handlers:
            super().emit(record)


def install_library_handler() -> None:
    """Give the `minivllm` logger its own handler in a caller's process (once), and
    `MINIVLLM_LOG_LEVEL` as its level unless one was set."""
    package = logging.getLogger("minivllm")
    if any(isinstance(h, _UnlessConfigured) for h in package.handlers):
        return
    handler = _UnlessConfigured()
    handler.setFormatter(formatter())
    package.addHandler(handler)
    if package.level == logging.NOTSET:
        package.setLevel(envs.log_level())
