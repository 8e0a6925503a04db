"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

400 for invalid parameters, malformed JSON and prompts longer than the context; 401 for a
missing or wrong API key; 404 for an unknown model; 503 once the engine is dead.
"""

from __future__ import annotations

import re
from http import HTTPStatus

import msgspec

from minivllm.exceptions import EngineDeadError

_TYPES = {
    HTTPStatus.BAD_REQUEST: "BadRequestError",
    HTTPStatus.UNAUTHORIZED: "AuthenticationError",
    HTTPStatus.NOT_FOUND: "NotFoundError",
    HTTPStatus.INTERNAL_SERVER_ERROR: "InternalServerError",
    HTTPStatus.SERVICE_UNAVAILABLE: "ServiceUnavailableError",
}


class OpenAIError(Exception):
    """An error to answer with: its status code, message and the parameter at fault."""

    def __init__(
        self, message: str, status: HTTPStatus = HTTPStatus.BAD_REQUEST, param: str | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param

    def body(self) -> bytes:
        error = {
            "message": self.message,
            "type": _TYPES.get(self.status, self.status.phrase),
            "param": self.param,
            "code": self.status.value,
        }
        return msgspec.json.encode({"error": error})


_JSON_PATH = re.compile(r"at `\$\.(\w+)")
_LEADING_NAME = re.compile(r"^(\w+)")


def from_decode_error(e: msgspec.DecodeError) -> OpenAIError:
    """A body that is not JSON, or a field of the wrong type (msgspec names it `$.field`)."""
    if not isinstance(e, msgspec.ValidationError):
        return OpenAIError(f"the body is not valid JSON: {e}")
    message = str(e)
    match = _JSON_PATH.search(message)
    return OpenAIError(message, param=match.group(1) if match else None)


def from_value_error(e: ValueError, fields: set[str] | frozenset[str]) -> OpenAIError:
    """The engine's ValueErrors name the parameter first ("temperature must be ..." or
    "prompt: ..."); that name becomes `param` when the request has such a field."""
    message = str(e)
    match = _LEADING_NAME.match(message)
    param = match.group(1) if match and match.group(1) in fields else None
    return OpenAIError(message, param=param)


def as_openai_error(e: Exception, fields: set[str] | frozenset[str] = frozenset()) -> OpenAIError:
    """What an error of a request answers: an OpenAIError as it is, a ValueError a 400 (see
    `from_value_error`), an `EngineDeadError` a 503."""
    if isinstance(e, OpenAIError):
        return e
    if isinstance(e, EngineDeadError):
        return OpenAIError(str(e), HTTPStatus.SERVICE_UNAVAILABLE)
    return from_value_error(e, fields)
