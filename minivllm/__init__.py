"""mini-vllm: a readable vLLM-V1-style inference engine.

The public names load on first use (PEP 562): the engine-core and worker processes import
only their own modules, never the frontend's tokenizer stack (transformers takes seconds to
import, and each spawned process would pay it again).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from minivllm.logging_utils import install_library_handler

if TYPE_CHECKING:
    from minivllm.config import EngineArgs  # noqa: F401 (re-exported)
    from minivllm.exceptions import EngineDeadError, EngineStartupError  # noqa: F401 (re-exported)
    from minivllm.frontend.async_llm import AsyncLLM  # noqa: F401 (re-exported)
    from minivllm.frontend.llm import LLM  # noqa: F401 (re-exported)
    from minivllm.frontend.llm_engine import LLMEngine  # noqa: F401 (re-exported)
    from minivllm.model_registry import ModelRegistry  # noqa: F401 (re-exported)
    from minivllm.outputs import CompletionOutput, Logprob, RequestOutput  # noqa: F401 (re-exported)
    from minivllm.protocol.auth import CurveClientKeys  # noqa: F401 (re-exported)
    from minivllm.protocol.sampling_params import RequestOutputKind, SamplingParams  # noqa: F401 (re-exported)
    from minivllm.protocol.structured_outputs import StructuredOutputsParams  # noqa: F401 (re-exported)

_EXPORTS = {
    "LLM": "minivllm.frontend.llm",
    "AsyncLLM": "minivllm.frontend.async_llm",
    "LLMEngine": "minivllm.frontend.llm_engine",
    "EngineArgs": "minivllm.config",
    "ModelRegistry": "minivllm.model_registry",
    "SamplingParams": "minivllm.protocol.sampling_params",
    "RequestOutputKind": "minivllm.protocol.sampling_params",
    "StructuredOutputsParams": "minivllm.protocol.structured_outputs",
    "RequestOutput": "minivllm.outputs",
    "CompletionOutput": "minivllm.outputs",
    "Logprob": "minivllm.outputs",
    "EngineDeadError": "minivllm.exceptions",
    "EngineStartupError": "minivllm.exceptions",
    "CurveClientKeys": "minivllm.protocol.auth",
}

__all__ = list(_EXPORTS)

install_library_handler()


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'minivllm' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
