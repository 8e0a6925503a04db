"""mini-vllm: a readable vLLM-V1-style inference engine."""

from minivllm.config import EngineArgs
from minivllm.exceptions import EngineDeadError, EngineStartupError
from minivllm.frontend.async_llm import AsyncLLM
from minivllm.frontend.llm import LLM
from minivllm.frontend.llm_engine import LLMEngine
from minivllm.logging_utils import install_library_handler
from minivllm.outputs import CompletionOutput, Logprob, RequestOutput
from minivllm.protocol.auth import CurveClientKeys
from minivllm.protocol.sampling_params import RequestOutputKind, SamplingParams
from minivllm.protocol.structured_outputs import StructuredOutputsParams

install_library_handler()

__all__ = [
    "LLM",
    "AsyncLLM",
    "LLMEngine",
    "EngineArgs",
    "SamplingParams",
    "RequestOutputKind",
    "StructuredOutputsParams",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
    "EngineDeadError",
    "EngineStartupError",
    "CurveClientKeys",
]
