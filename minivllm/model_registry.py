"""Models from outside the package, as vLLM registers them:

    from minivllm import ModelRegistry
    ModelRegistry.register_model("MyForCausalLM", "my_package.my_model:MyForCausalLM")

and a checkpoint whose config.json names "MyForCausalLM" in `architectures` loads that class.

A registration is a name ("module:Class"), imported only where the model is built, in the
worker processes, so the process that registers needs no torch. Those processes are spawned,
so they do not share the registering process's memory: every process an engine spawns starts
with the registrations of the process that spawned it (`process_utils.spawn`; the Ray
executor hands them to its actors). A process started on its own (`minivllm serve`,
`minivllm engine-core`) gets them from plugins: MINIVLLM_PLUGINS names `module:function`s,
each called once in every process before its registry is first read (vLLM's general
plugins, which vLLM finds through entry points). A registration made in code overrides a
plugin's for the same architecture.

The class is built as `cls(model_config, variant, tp, attn_backend, params_dtype=dtype)` on
the target device, then `load_weights(iterable of (name, tensor))` (for a checkpoint's
weights; with load_format "dummy" nothing is loaded); a step calls
`forward(input_ids, positions, kv_caches, attn_metadata)` for the hidden states and
`compute_logits(hidden)` for the logits of the rows that sample. The smallest such model is
minivllm/benchmarks/null_model.py.
"""

from __future__ import annotations

import importlib
import logging
import re
import threading
from typing import Any

from minivllm import envs

logger = logging.getLogger(__name__)

_IMPORT_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")


class _ModelRegistry:
    """Out-of-tree architectures: name -> "module:Class". The built-in ones are the worker's
    (worker/models/registry.py), which consults this table first."""

    def __init__(self) -> None:
        self._models: dict[str, str] = {}
        self._plugins_loaded = False
        self._lock = threading.RLock()

    def register_model(self, architecture: str, model_cls: str | type) -> None:
        """Load `model_cls` for checkpoints whose config.json's architecture is
        `architecture`. `model_cls` is "module:Class", or a class that can be imported by
        that name (not one defined in `__main__` or inside a function)."""
        if not isinstance(architecture, str) or not architecture:
            raise ValueError(f"architecture must be a non-empty string, got {architecture!r}")
        path = _import_path(model_cls)
        with self._lock:
            self._load_plugins()
            previous = self._models.get(architecture)
            if previous not in (None, path):
                logger.warning("architecture %s: %s replaces %s", architecture, path, previous)
            self._models[architecture] = path

    def get_supported_archs(self) -> list[str]:
        """The out-of-tree architectures registered in this process."""
        return sorted(self.registered())

    def registered(self) -> dict[str, str]:
        """architecture -> "module:Class" of every registration, the plugins' included."""
        with self._lock:
            self._load_plugins()
            return dict(self._models)

    def restore(self, models: dict[str, str]) -> None:
        """Register what another process's `registered()` returned (a spawned process
        starts with its parent's registrations)."""
        for architecture, path in models.items():
            self.register_model(architecture, path)

    def model_class(self, architecture: str) -> type | None:
        """The class registered for `architecture`, imported now; None if there is none.
        ValueError naming the registration if it does not import."""
        path = self.registered().get(architecture)
        if path is None:
            return None
        module_name, _, qualname = path.partition(":")
        try:
            obj: Any = importlib.import_module(module_name)
            for part in qualname.split("."):
                obj = getattr(obj, part)
        except (ImportError, AttributeError) as e:
            raise ValueError(
                f"architecture {architecture!r} is registered as {path!r}, which does not "
                f"import: {type(e).__name__}: {e}"
            ) from e
        return obj

    def _load_plugins(self) -> None:
        if self._plugins_loaded:
            return
        self._plugins_loaded = True  # first: a plugin registers through this registry
        for plugin in envs.plugins():
            if not _IMPORT_PATH.match(plugin):
                raise ValueError(f"MINIVLLM_PLUGINS: {plugin!r} is not 'module:function'")
            module_name, _, function = plugin.partition(":")
            try:
                register = getattr(importlib.import_module(module_name), function)
            except (ImportError, AttributeError) as e:
                raise ValueError(
                    f"MINIVLLM_PLUGINS: {plugin!r} does not import: {type(e).__name__}: {e}"
                ) from e
            register()


def _import_path(model_cls: str | type) -> str:
    if isinstance(model_cls, str):
        if not _IMPORT_PATH.match(model_cls):
            raise ValueError(f"model_cls must be 'module:Class', got {model_cls!r}")
        return model_cls
    if not isinstance(model_cls, type):
        raise ValueError(f"model_cls must be 'module:Class' or a class, got {model_cls!r}")
    module, qualname = model_cls.__module__, model_cls.__qualname__
    if module == "__main__" or "<locals>" in qualname:
        raise ValueError(
            f"model_cls {qualname} cannot be imported by name in the engine's processes "
            f"(it is defined in {'__main__' if module == '__main__' else 'a function'}); "
            "define it in a module and register 'module:Class'"
        )
    return f"{module}:{qualname}"


ModelRegistry = _ModelRegistry()
