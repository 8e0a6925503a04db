"""Errors that reach users of the engine."""


class EngineDeadError(RuntimeError):
    """The engine-core (or one of its workers) died: no request in flight will finish."""


class EngineStartupError(RuntimeError):
    """A process of the engine failed to start; the message names it, its exit code and why."""


class EngineCoreDeadError(EngineDeadError):
    """One of several data-parallel engine-cores died. Only the requests it held end with
    this error; the frontend routes new requests to the cores that live."""

    def __init__(self, message: str, engine_index: int, request_ids: list[str]) -> None:
        super().__init__(message)
        self.engine_index = engine_index
        self.request_ids = request_ids  # the engine-internal ids that were on that core
