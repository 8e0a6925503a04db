"""transformers and xgrammar, imported under one lock. transformers loads its submodules
lazily, and two threads importing from it (or from xgrammar, which imports it) at once can
fail ("cannot import name ..."): the frontend's tokenizer thread (at start-up), an in-process
engine-core's grammar compiler thread (with the first grammar) and the caller's thread all
may.
"""

from __future__ import annotations

import importlib
import threading
from types import ModuleType
from typing import Any

_lock = threading.RLock()


def import_locked(module: str) -> ModuleType:
    """`import module`, one thread at a time."""
    with _lock:
        return importlib.import_module(module)


def from_transformers(module: str, name: str) -> Any:
    """`from transformers<.module> import name`, one thread at a time (module "" for the
    package itself)."""
    with _lock:
        return getattr(import_locked("transformers" + (module and "." + module)), name)
