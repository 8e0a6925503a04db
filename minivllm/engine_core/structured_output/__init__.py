"""Structured outputs in the engine-core: grammar compilation, matchers, token bitmasks."""

from minivllm.engine_core.structured_output.manager import (
    StructuredOutputManager,
    StructuredOutputRequest,
)

__all__ = ["StructuredOutputManager", "StructuredOutputRequest"]
