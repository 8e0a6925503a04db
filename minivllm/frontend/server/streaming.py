"""Server-sent events, several generators merged into one stream, and requests that end
when their client leaves.

A client that disconnects must have its requests aborted within a second, whether or not
tokens are flowing: `StreamingResponse` alone notices only when a write fails, which never
happens while a request waits in the queue. So both response paths race the work against
the ASGI `http.disconnect` message and cancel it; cancelling the consumer of
`AsyncLLM.generate` aborts the request in the engine.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from minivllm.exceptions import EngineDeadError
from minivllm.frontend.server.errors import as_openai_error
from minivllm.frontend.server.protocol import StreamOptions, StreamResponse, UsageInfo

T = TypeVar("T")

_encode = msgspec.json.Encoder().encode


def sse(payload: Any) -> bytes:
    """One `data:` event carrying `payload` as JSON."""
    return b"data: " + _encode(payload) + b"\n\n"


async def _wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _until_disconnect(receive: Receive, work: Awaitable[T]) -> asyncio.Future[T]:
    """Run `work` to its end, or until the client disconnects (then cancel it); its task."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(receive))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    return task


_SERVER_SEND = "minivllm.server_send"


def with_server_send(app: ASGIApp) -> ASGIApp:
    """`app`, with the ASGI server's own `send` kept in the scope for stream bodies."""

    async def asgi(scope: Scope, receive: Receive, send: Send) -> None:
        scope[_SERVER_SEND] = send
        await app(scope, receive, send)

    return asgi


class EventStreamResponse(Response):
    """`text/event-stream` of a view's chunks for `streams`' outputs, then `data: [DONE]`,
    cancelled as soon as the client disconnects. An error after the stream started (the
    headers are gone) becomes one `data: {"error": ...}` event, as vLLM sends it.

    Each chunk goes to the ASGI server straight from the loop over the request's outputs
    (and skips Starlette's two `send` wrappers, which only notice that the response
    started): every layer here costs every token of every stream."""

    media_type = "text/event-stream"

    def __init__(self, streams: list[AsyncIterator[Any]], view: StreamView) -> None:
        self.streams, self.view = streams, view
        self.status_code = 200
        self.background = None
        self.init_headers()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        stream = await _until_disconnect(receive, self._stream(send, scope.get(_SERVER_SEND)))
        error = None if stream.cancelled() else stream.exception()
        if error is not None and not isinstance(error, OSError):  # OSError: the client left
            raise error

    async def _stream(self, send: Send, server_send: Send | None) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        body_send = server_send or send
        view, streams = self.view, self.streams
        try:
            for chunk in view.first_chunks():
                await body_send(
                    {"type": "http.response.body", "body": sse(chunk), "more_body": True}
                )
            if len(streams) == 1:
                async for output in streams[0]:
                    for chunk in view.chunks(0, output):
                        body = sse(chunk)
                        await body_send(
                            {"type": "http.response.body", "body": body, "more_body": True}
                        )
            else:
                async for i, output in merge(streams):
                    for chunk in view.chunks(i, output):
                        body = sse(chunk)
                        await body_send(
                            {"type": "http.response.body", "body": body, "more_body": True}
                        )
            tail = b"".join(sse(chunk) for chunk in view.last_chunks())
        except (ValueError, EngineDeadError) as e:
            tail = b"data: " + as_openai_error(e).body() + b"\n\n"
        # the usage chunk, [DONE] and the end of the body in one write
        body = tail + b"data: [DONE]\n\n"
        await body_send({"type": "http.response.body", "body": body, "more_body": False})


async def merge(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Items of all `streams` as they come, each with its stream's index (each stream runs
    as a task). Leaving early closes them all."""
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
    end = object()

    async def drain(i: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                await queue.put((i, item))
        except BaseException as e:  # the consumer re-raises it
            await queue.put((i, e))
            return
        await queue.put((i, end))

    tasks = [asyncio.ensure_future(drain(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is end:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class StreamView:
    """One request's outputs as an endpoint answers them: `response` (whole) or chunks.

    Subclasses make `response(finals)`, `chunks(i, output)` and, if they open a stream with
    something, `first_chunks()`. Usage goes in every chunk with `continuous_usage_stats`,
    and in a last chunk without choices with `include_usage`.
    """

    object = ""  # the "object" of a stream chunk

    def __init__(
        self, request_id: str, model: str, num_prompt_tokens: int, options: StreamOptions | None
    ) -> None:
        self.request_id = request_id
        self.model = model
        self.created = int(time.time())
        self.num_prompt_tokens = num_prompt_tokens
        self.options = options
        self.continuous = options is not None and options.continuous_usage_stats
        self.num_tokens = 0  # generated so far, all choices

    def usage(self, completion_tokens: int) -> UsageInfo:
        p = self.num_prompt_tokens
        return UsageInfo(p, p + completion_tokens, completion_tokens)

    def chunk(self, choices: list[Any], num_new_tokens: int = 0) -> StreamResponse:
        self.num_tokens += num_new_tokens
        chunk = StreamResponse(self.request_id, self.object, self.created, self.model, choices)
        if self.continuous:
            chunk.usage = self.usage(self.num_tokens)
        return chunk

    def first_chunks(self) -> list[StreamResponse]:
        return []

    def chunks(self, i: int, output: Any) -> list[StreamResponse]:
        raise NotImplementedError

    def last_chunks(self) -> list[StreamResponse]:
        if self.options is None or not self.options.include_usage:
            return []
        usage = self.usage(self.num_tokens)
        return [StreamResponse(self.request_id, self.object, self.created, self.model, [], usage)]


async def respond(
    raw: Request,
    streams: list[AsyncIterator[Any]],
    view: StreamView,
    stream: bool,
) -> Response:
    """The response to one request: an event stream of the view's chunks, or the view's
    response body once every stream has ended (FINAL_ONLY outputs: one per stream)."""
    if stream:
        return EventStreamResponse(streams, view)
    finals: list[Any] = [None] * len(streams)

    async def run() -> None:
        async for i, out in merge(streams):
            finals[i] = out

    task = await _until_disconnect(raw.receive, run())
    if task.cancelled():
        raise asyncio.CancelledError("the client disconnected")
    task.result()  # raises what the request raised
    return Response(_encode(view.response(finals)), media_type="application/json")
