"""The FastAPI app: OpenAI's routes plus vLLM's `/health`, `/version`, `/tokenize`,
`/detokenize` and `/metrics`, over one `AsyncLLM`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import AsyncIterator
from http import HTTPStatus
from importlib import metadata
from typing import Any, TypeVar

import msgspec
from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response

from minivllm import envs
from minivllm.exceptions import EngineDeadError
from minivllm.frontend.async_llm import AsyncLLM
from minivllm.frontend.metrics.prometheus import PrometheusStatLogger
from minivllm.frontend.server.chat import create_chat_completion, render_chat
from minivllm.frontend.server.completions import create_completion
from minivllm.frontend.server.errors import (
    OpenAIError,
    as_openai_error,
    from_decode_error,
)
from minivllm.frontend.server.protocol import (
    DetokenizeRequest,
    ModelCard,
    ModelList,
    ModelPermission,
    TokenizeRequest,
)
from minivllm.frontend.server.sampling import ServerDefaults
from minivllm.protocol.messages import SchedulerStats
from minivllm.protocol.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

T = TypeVar("T")
_PARAM_NAMES = frozenset(SamplingParams.__struct_fields__) | {"prompt", "messages", "model"}
_decode_keys = msgspec.json.Decoder(dict[str, msgspec.Raw]).decode
_MAX_WARNED_FIELDS = 1024  # unknown field names remembered (each is warned about once)


class ServerState:
    """The engine and what the routes need to know about it."""

    def __init__(
        self,
        engine: AsyncLLM,
        served_model_names: list[str],
        chat_template: str | None = None,
        api_key: str | None = None,
        metrics: PrometheusStatLogger | None = None,
        log_requests: bool = False,
        max_log_len: int | None = None,
    ) -> None:
        self.engine = engine
        self.served_model_names = served_model_names
        self.model_name = served_model_names[0]
        self.chat_template = chat_template
        self.api_key = api_key
        self.metrics = metrics
        self.log_requests = log_requests
        self.max_log_len = max_log_len
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.model_config.max_model_len
        self.max_token_id = engine.input_processor.max_token_id
        self.sampling_defaults = ServerDefaults.of(engine.model_config)
        self._warned_fields: set[str] = set()

    # ---------------------------------------------------------------- checks

    def check_api_key(self, raw: Request) -> None:
        if self.api_key is not None and not secrets.compare_digest(
            raw.headers.get("authorization", ""), f"Bearer {self.api_key}"
        ):
            raise OpenAIError("Unauthorized", HTTPStatus.UNAUTHORIZED)

    def check_model(self, model: str | None) -> str:
        """The name to answer with: the one asked for, or the first served name."""
        if model is None:
            return self.model_name
        if model not in self.served_model_names:
            message = f"The model `{model}` does not exist."
            raise OpenAIError(message, HTTPStatus.NOT_FOUND, param="model")
        return model

    def check_prompt(self, ids: list[int], param: str) -> None:
        if not ids:
            raise OpenAIError(f"{param}: the prompt is empty", param=param)
        bad = next((t for t in ids if not 0 <= t <= self.max_token_id), None)
        if bad is not None:
            raise OpenAIError(
                f"{param}: token id {bad} is out of vocabulary (valid ids are "
                f"0..{self.max_token_id})",
                param=param,
            )
        if len(ids) >= self.max_model_len:
            raise OpenAIError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"your prompt contains {len(ids)} input tokens, which leaves no room for any "
                "output token. Please reduce the length of the input prompt.",
                param=param,
            )

    def check_params(self, params: SamplingParams) -> None:
        """What the engine would refuse, refused before a stream starts (as a 400: the app
        answers a ValueError so)."""
        max_tokens = params.max_tokens
        if max_tokens is not None and max_tokens > self.max_model_len:
            raise OpenAIError(
                f"max_tokens={max_tokens} cannot be greater than max_model_len="
                f"{self.max_model_len}. Please request fewer output tokens.",
                param="max_tokens",
            )
        self.engine.input_processor.validate_params(params)

    # ---------------------------------------------------------------- helpers

    def decode(self, body: bytes, kind: type[T]) -> T:
        try:
            request = msgspec.json.decode(body, type=kind)
        except msgspec.DecodeError as e:
            raise from_decode_error(e) from None
        self._warn_unknown_fields(body, kind)
        return request

    def _warn_unknown_fields(self, body: bytes, kind: type) -> None:
        """Fields the request has and `kind` does not are ignored, as in vLLM; each name is
        logged once (a client that keeps sending it is not news)."""
        unknown = _decode_keys(body).keys() - set(kind.__struct_fields__) - self._warned_fields
        if not unknown or len(self._warned_fields) >= _MAX_WARNED_FIELDS:
            return
        self._warned_fields |= unknown
        names = sorted(name[:100] for name in unknown)
        logger.warning("The following fields were present in the request but ignored: %s", names)

    def log_request(self, request_id: str, ids: list[int], params: SamplingParams) -> None:
        """`--enable-log-requests`, vLLM's lines: the params at INFO, the prompt at DEBUG."""
        if not self.log_requests:
            return
        logger.info("Received request %s: params: %s", request_id, params)
        if logger.isEnabledFor(logging.DEBUG):
            shown = ids if self.max_log_len is None else ids[: self.max_log_len]
            logger.debug("Request %s details: prompt_token_ids: %s", request_id, shown)

    def json(self, payload: Any) -> Response:
        return Response(msgspec.json.encode(payload), media_type="application/json")

    def request_id(self, prefix: str) -> str:
        return f"{prefix}-{secrets.token_hex(8)}"

    def tokenize(self, text: str, add_special_tokens: bool, param: str) -> list[int]:
        if self.tokenizer is None:
            raise OpenAIError(
                f"{param}: a text prompt needs a tokenizer, but the server runs with "
                "--skip-tokenizer-init; send token ids",
                param=param,
            )
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def detokenize(self, ids: list[int]) -> str:
        return "" if self.tokenizer is None else self.tokenizer.decode(ids)

    def decode_token(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id])


def build_app(state: ServerState) -> FastAPI:
    """The app over `state.engine`; the lifespan starts the engine client and the stats log,
    and shuts the engine down at exit."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await state.engine.check_health()  # starts the client's heartbeat and reader
        task = asyncio.create_task(_log_stats_forever(state), name="stats-log")
        try:
            yield
        finally:
            task.cancel()
            state.engine.shutdown()

    app = FastAPI(lifespan=lifespan, docs_url=None, redoc_url=None)

    async def openai_error(_: Request, e: Exception) -> Response:
        error = as_openai_error(e, _PARAM_NAMES)
        return Response(error.body(), error.status.value, media_type="application/json")

    for kind in (OpenAIError, ValueError, EngineDeadError):
        app.add_exception_handler(kind, openai_error)

    @app.post("/v1/completions")
    async def completions(raw: Request) -> Response:
        state.check_api_key(raw)
        return await create_completion(state, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request) -> Response:
        state.check_api_key(raw)
        return await create_chat_completion(state, raw)

    @app.get("/v1/models")
    async def models(raw: Request) -> Response:
        state.check_api_key(raw)
        now = int(time.time())
        cards = [
            ModelCard(
                id=name,
                created=now,
                root=state.engine.model_config.model,
                max_model_len=state.max_model_len,
                permission=[ModelPermission(f"modelperm-{secrets.token_hex(8)}", now)],
            )
            for name in state.served_model_names
        ]
        return state.json(ModelList(cards))

    @app.get("/health")
    async def health() -> Response:
        try:
            await asyncio.wait_for(state.engine.check_health(), timeout=10)
        except Exception as e:  # dead, or too slow to answer: either way not serving
            logger.warning("health check failed: %s", e)
            return Response(status_code=HTTPStatus.SERVICE_UNAVAILABLE)
        return Response(status_code=HTTPStatus.OK)

    @app.get("/version")
    async def version() -> Response:
        try:
            number = metadata.version("minivllm")
        except metadata.PackageNotFoundError:
            number = "unknown"
        return state.json({"version": number})

    @app.get("/metrics")
    async def metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        if state.metrics is None:  # --disable-log-stats: the process's own metrics only
            return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)
        await _refresh_scheduler_stats(state)
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize")
    async def tokenize(raw: Request) -> Response:
        request = state.decode(await raw.body(), TokenizeRequest)
        state.check_model(request.model)
        if request.messages is not None:
            ids = render_chat(state, request.messages, request)["prompt_token_ids"]
        elif request.prompt is not None:
            ids = state.tokenize(request.prompt, request.add_special_tokens, "prompt")
        else:
            raise OpenAIError("tokenize needs a prompt or messages", param="prompt")
        strs = None
        if request.return_token_strs and state.tokenizer is not None:
            strs = state.tokenizer.convert_ids_to_tokens(ids)
        body = {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids}
        return state.json({**body, "token_strs": strs})

    @app.post("/detokenize")
    async def detokenize(raw: Request) -> Response:
        request = state.decode(await raw.body(), DetokenizeRequest)
        state.check_model(request.model)
        if state.tokenizer is None:
            raise OpenAIError("detokenize needs a tokenizer (--skip-tokenizer-init is on)")
        state.check_prompt(request.tokens, "tokens")
        return state.json({"prompt": state.detokenize(request.tokens)})

    return app


async def _refresh_scheduler_stats(state: ServerState) -> None:
    """Ask the engine-core for its scheduler now: the last output may be long ago (an
    aborted request leaves no output behind), and gauges must not show stale load."""
    stats = state.engine.stats
    if stats is None or state.engine.errored:
        return
    try:
        snapshot = await asyncio.wait_for(state.engine.get_stats(), timeout=2)
    except Exception as e:
        logger.debug("no scheduler stats: %s", e)
        return
    stats.record_scheduler_stats(SchedulerStats(**snapshot))


async def _log_stats_forever(state: ServerState) -> None:
    interval_s = envs.log_stats_interval_s()
    while True:
        await asyncio.sleep(interval_s)
        await _refresh_scheduler_stats(state)
        state.engine.do_log_stats()
