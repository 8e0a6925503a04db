"""`POST /v1/chat/completions`: messages rendered with the tokenizer's chat template (or the
server's `--chat-template`, or the request's `chat_template`), `n` choices, streamed as SSE
deltas (a first chunk per choice carries the role) or returned whole."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeVar

from starlette.requests import Request
from starlette.responses import Response

from minivllm.frontend.server.errors import OpenAIError
from minivllm.frontend.server.logprobs import chat_logprobs
from minivllm.frontend.server.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    ChatStreamChoice,
    DeltaMessage,
    StreamResponse,
)
from minivllm.frontend.server.sampling import chat_sampling_params
from minivllm.frontend.server.streaming import StreamView, respond
from minivllm.outputs import CompletionOutput, RequestOutput

if TYPE_CHECKING:
    from minivllm.frontend.server.app import ServerState

C = TypeVar("C", ChatChoice, ChatStreamChoice)


async def create_chat_completion(state: ServerState, raw: Request) -> Response:
    request = state.decode(await raw.body(), ChatCompletionRequest)
    model = state.check_model(request.model)
    prompt = render_chat(state, request.messages, request)
    state.check_prompt(prompt["prompt_token_ids"], "messages")
    params = chat_sampling_params(request, request.stream, state.sampling_defaults)
    state.check_params(params)
    request_id = state.request_id("chatcmpl")
    state.log_request(request_id, prompt["prompt_token_ids"], params)
    stream = state.engine.generate(prompt, params, request_id)
    view = _ChatView(request, len(prompt["prompt_token_ids"]), request_id, model)
    return await respond(raw, [stream], view, request.stream)


def render_chat(state: ServerState, messages: list[dict[str, Any]], request: Any) -> dict[str, Any]:
    """Messages -> `{"prompt": text, "prompt_token_ids": ids}` through the chat template."""
    if state.engine.tokenizer is None:
        raise OpenAIError(
            "messages: chat needs a tokenizer, but the server runs with --skip-tokenizer-init",
            param="messages",
        )
    if not messages:
        raise OpenAIError("messages must not be empty", param="messages")
    kwargs = dict(getattr(request, "chat_template_kwargs", None) or {})
    add_generation_prompt = request.add_generation_prompt
    if getattr(request, "continue_final_message", False):
        kwargs["continue_final_message"] = True
        add_generation_prompt = False
    messages = [_text_message(m) for m in messages]
    try:
        return state.engine.input_processor.apply_chat_template(
            messages,
            add_generation_prompt=add_generation_prompt,
            chat_template=getattr(request, "chat_template", None) or state.chat_template,
            template_kwargs=kwargs,
        )
    except Exception as e:  # a template that fails to render on these messages
        raise OpenAIError(f"messages: the chat template failed: {e}", param="messages") from e


def _text_message(message: dict[str, Any]) -> dict[str, Any]:
    """A message with its content as one string (text parts joined), as templates expect."""
    if "role" not in message:
        raise OpenAIError(
            f"messages: each message needs a role, got {message!r:.80}", param="messages"
        )
    content = message.get("content")
    if content is None:
        content = ""
    elif isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise OpenAIError(
                    f"messages: only text content parts are supported, got {part!r:.80}",
                    param="messages",
                )
            texts.append(part.get("text", ""))
        content = "\n".join(texts)
    elif not isinstance(content, str):
        raise OpenAIError(
            f"messages: content must be a string or a list of parts, got {content!r:.80}",
            param="messages",
        )
    return {**message, "content": content}


class _ChatView(StreamView):
    """One chat request's `RequestOutput`s as a response body or stream chunks."""

    object = "chat.completion.chunk"

    def __init__(
        self,
        request: ChatCompletionRequest,
        num_prompt_tokens: int,
        request_id: str,
        model: str,
    ) -> None:
        super().__init__(request_id, model, num_prompt_tokens, request.stream_options)
        self.request = request
        self.num_top = (request.top_logprobs or 0) if request.logprobs else None

    def _choice(self, kind: type[C], c: CompletionOutput, body: Any) -> C:
        """Completion `c` as a `kind` choice (whole or streamed), `body` its message or delta."""
        logprobs = None
        if self.num_top is not None and c.logprobs is not None:
            logprobs = chat_logprobs(c.token_ids, c.logprobs, self.num_top)
        token_ids = c.token_ids if self.request.return_token_ids else None
        return kind(c.index, body, logprobs, c.finish_reason, c.stop_reason, token_ids)

    def response(self, finals: list[RequestOutput]) -> ChatCompletionResponse:
        (out,) = finals
        return ChatCompletionResponse(
            id=self.request_id,
            created=self.created,
            model=self.model,
            choices=[self._choice(ChatChoice, c, ChatMessage(c.text)) for c in out.outputs],
            usage=self.usage(sum(len(c.token_ids) for c in out.outputs)),
            prompt_token_ids=out.prompt_token_ids if self.request.return_token_ids else None,
        )

    def first_chunks(self) -> list[StreamResponse]:
        """The role, once per choice, before any text (as OpenAI and vLLM send it)."""
        role = DeltaMessage(role="assistant", content="")
        return [self.chunk([ChatStreamChoice(i, role)]) for i in range(self.request.n)]

    def chunks(self, i: int, out: RequestOutput) -> list[StreamResponse]:
        return [
            self.chunk(
                [self._choice(ChatStreamChoice, c, DeltaMessage(content=c.text))], len(c.token_ids)
            )
            for c in out.outputs
        ]
