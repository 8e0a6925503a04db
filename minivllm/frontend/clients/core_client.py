"""The frontend's side of the engine-core: the client interface and the in-process client.
The ZMQ clients (a spawned engine-core or an attached daemon) are in mp_client.py."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from minivllm.config import EngineConfig
from minivllm.protocol.messages import (
    EngineCoreOutputs,
    EngineCoreRequest,
    UtilityMethod,
)


class EngineCoreClient(ABC):
    @abstractmethod
    def add_request(self, request: EngineCoreRequest) -> None: ...

    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        """The n > 1 children of one user request (a data-parallel client keeps them on
        one core)."""
        for request in requests:
            self.add_request(request)

    @abstractmethod
    def abort_requests(self, request_ids: list[str]) -> None: ...

    @abstractmethod
    def get_output(self) -> EngineCoreOutputs:
        """The next batch of outputs for this client (blocks until there is one)."""

    @abstractmethod
    def call_utility(self, method: UtilityMethod) -> Any: ...

    @abstractmethod
    def shutdown(self) -> None: ...


class InprocClient(EngineCoreClient):
    """`EngineCore` in this process: steps run inside `get_output()`."""

    def __init__(self, config: EngineConfig) -> None:
        from minivllm.engine_core.engine_core import EngineCore

        self.core = EngineCore(config)

    def add_request(self, request: EngineCoreRequest) -> None:
        self.core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.core.abort_requests(request_ids)

    def get_output(self) -> EngineCoreOutputs:
        while self.core.has_work():
            outputs = self.core.step()
            if outputs:
                return outputs[0]
        return EngineCoreOutputs()

    def call_utility(self, method: UtilityMethod) -> Any:
        return self.core.call_utility(method)

    def shutdown(self) -> None:
        self.core.shutdown()
