"""`POST /v1/completions`: prompts as text, a list of texts, token ids or lists of them;
`n` choices per prompt (choice index = prompt index * n + completion index); streamed as
SSE deltas or returned whole."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response

from minivllm.frontend.server.errors import OpenAIError
from minivllm.frontend.server.logprobs import completion_logprobs, prompt_logprobs_json
from minivllm.frontend.server.protocol import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    StreamResponse,
)
from minivllm.frontend.server.sampling import completion_sampling_params
from minivllm.frontend.server.streaming import StreamView, respond
from minivllm.outputs import CompletionOutput, RequestOutput

if TYPE_CHECKING:
    from minivllm.frontend.server.app import ServerState

Prompt = tuple[str | None, list[int]]  # (text if given as text, token ids)


async def create_completion(state: ServerState, raw: Request) -> Response:
    request = state.decode(await raw.body(), CompletionRequest)
    model = state.check_model(request.model)
    if request.suffix:
        raise OpenAIError("suffix is not supported", param="suffix")
    if request.best_of is not None and request.best_of != request.n:
        raise OpenAIError("best_of must equal n (or be omitted)", param="best_of")
    prompts = _prompts(state, request)
    params = completion_sampling_params(request, request.stream, state.sampling_defaults)
    state.check_params(params)
    request_id = state.request_id("cmpl")
    for i, (_, ids) in enumerate(prompts):
        state.log_request(f"{request_id}-{i}", ids, params)
    streams = [
        state.engine.generate(
            {"prompt": text, "prompt_token_ids": ids}, params, f"{request_id}-{i}"
        )
        for i, (text, ids) in enumerate(prompts)
    ]
    view = _CompletionView(state, request, prompts, request_id, model)
    return await respond(raw, streams, view, request.stream)


def _prompts(state: ServerState, request: CompletionRequest) -> list[Prompt]:
    prompt = request.prompt
    if prompt is None or prompt == "" or prompt == []:
        raise OpenAIError("prompt: you must pass at least one non-empty prompt", param="prompt")
    # one prompt (a text or token ids), or a list of them
    several = isinstance(prompt, list) and not all(_is_id(t) for t in prompt)
    items: list[Any] = prompt if several else [prompt]
    prompts = []
    for item in items:
        if isinstance(item, str):
            prompts.append((item, state.tokenize(item, request.add_special_tokens, "prompt")))
        elif isinstance(item, list) and item and all(_is_id(t) for t in item):
            prompts.append((None, item))
        else:
            raise OpenAIError(
                "prompt must be a string, a list of strings, a list of token ids or a list of "
                f"lists of token ids; got {type(item).__name__} {item!r:.60}",
                param="prompt",
            )
    for _, ids in prompts:
        state.check_prompt(ids, "prompt")
    return prompts


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class _CompletionView(StreamView):
    """One completions request's `RequestOutput`s as a response body or stream chunks."""

    object = "text_completion"

    def __init__(
        self,
        state: ServerState,
        request: CompletionRequest,
        prompts: list[Prompt],
        request_id: str,
        model: str,
    ) -> None:
        num_prompt_tokens = sum(len(ids) for _, ids in prompts)
        super().__init__(request_id, model, num_prompt_tokens, request.stream_options)
        self.state = state
        self.request = request
        self.prompts = prompts
        self.text_len: dict[int, int] = {}  # text streamed so far, per choice

    def _prompt_text(self, i: int) -> str:
        text, ids = self.prompts[i]
        return text if text is not None else self.state.detokenize(ids)

    def _choice(
        self, i: int, out: RequestOutput, c: CompletionOutput, text_offset: int, first: bool
    ) -> CompletionChoice:
        """The choice for completion `c` of prompt `i`; `first`: its first chunk (or whole)."""
        request = self.request
        text, token_ids = c.text, c.token_ids
        logprobs = None
        if request.logprobs is not None:
            steps = c.logprobs or [None] * len(token_ids)
            if request.echo and first:
                prompt_ids = self.prompts[i][1]
                prompt_steps = out.prompt_logprobs or [None] * len(prompt_ids)
                token_ids, steps = prompt_ids + token_ids, list(prompt_steps) + list(steps)
            logprobs = completion_logprobs(
                token_ids, steps, request.logprobs, text_offset, self.state.decode_token
            )
        if request.echo and first:
            text = self._prompt_text(i) + text
        choice = CompletionChoice(
            index=i * request.n + c.index,
            text=text,
            logprobs=logprobs,
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
        )
        if request.return_token_ids:
            choice.token_ids = c.token_ids
            if first:
                choice.prompt_token_ids = self.prompts[i][1]
        if first and request.prompt_logprobs is not None:
            choice.prompt_logprobs = prompt_logprobs_json(out.prompt_logprobs)
        return choice

    def response(self, finals: list[RequestOutput]) -> CompletionResponse:
        choices = [
            self._choice(i, out, c, 0, True) for i, out in enumerate(finals) for c in out.outputs
        ]
        choices.sort(key=lambda c: c.index)
        return CompletionResponse(
            id=self.request_id,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=self.usage(sum(len(c.token_ids) for o in finals for c in o.outputs)),
        )

    def chunks(self, i: int, out: RequestOutput) -> list[StreamResponse]:
        """A DELTA output -> one chunk per completion delta in it."""
        chunks = []
        for c in out.outputs:
            index = i * self.request.n + c.index
            offset = self.text_len.get(index)
            choice = self._choice(i, out, c, offset or 0, offset is None)
            self.text_len[index] = (offset or 0) + len(choice.text)
            chunks.append(self.chunk([choice], len(c.token_ids)))
        return chunks
