"""transformers' names, imported under one lock. Its package loads its submodules lazily, and
two threads importing from it at once can fail ("cannot import name ...") — as the frontend's
tokenizer thread and an in-process engine-core's grammar compiler thread both do at start-up.
"""

from __future__ import annotations

import importlib
import threading
from typing import Any

_lock = threading.Lock()


def from_transformers(module: str, name: str) -> Any:
    """`from transformers<.module> import name`, one thread at a time (module "" for the
    package itself)."""
    with _lock:
        return getattr(importlib.import_module("transformers" + (module and "." + module)), name)
