"""Errors that reach users of the engine."""


class EngineDeadError(RuntimeError):
    """The engine-core (or one of its workers) died: no request in flight will finish."""


class EngineStartupError(RuntimeError):
    """A process of the engine failed to start; the message names it, its exit code and why."""
