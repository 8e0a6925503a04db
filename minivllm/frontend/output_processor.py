"""From engine-core outputs (token ids) to the `RequestOutput`s users see."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from minivllm.frontend.detokenizer import IncrementalDetokenizer
from minivllm.frontend.logprobs import RequestLogprobs, TokenTexts
from minivllm.frontend.parent_request import ParentRequest
from minivllm.frontend.tokenizer import Tokenizer
from minivllm.outputs import CompletionOutput, PromptLogprobs, RequestOutput
from minivllm.protocol.messages import EngineCoreOutput, EngineCoreRequest, FinishReason
from minivllm.protocol.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from minivllm.frontend.input_processor import InputProcessor, PromptType


@dataclass
class ProcessedOutputs:
    """What one batch of engine-core outputs became."""

    request_outputs: list[RequestOutput] = field(default_factory=list)
    # internal ids that a stop string (or a failed sibling) ended here while the engine-core
    # still runs them: the caller must abort them in the core
    reqs_to_abort: list[str] = field(default_factory=list)
    # user request id -> error text, for requests that failed; the caller raises
    errors: dict[str, str] = field(default_factory=dict)


class RequestOutputCollector:
    """The output of one request that its consumer has not taken yet (AsyncLLM).

    Outputs that arrive before the consumer took the previous one are merged (DELTA: text
    and ids appended) or replace it (CUMULATIVE, FINAL_ONLY: the newest says it all), so a
    slow consumer gets fewer, larger outputs instead of a growing queue, as in vLLM. An
    exception replaces whatever waits and ends the stream.
    """

    __slots__ = ("output", "_delta", "_waiter")

    def __init__(self, output_kind: RequestOutputKind) -> None:
        self.output: RequestOutput | BaseException | None = None
        self._delta = output_kind == RequestOutputKind.DELTA
        self._waiter: asyncio.Future[None] | None = None

    def put(self, output: RequestOutput | BaseException) -> None:
        prev = self.output
        if prev is None or isinstance(output, BaseException) or not self._delta:
            self.output = output
        elif isinstance(prev, RequestOutput):
            _merge_delta(prev, output)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def get(self) -> RequestOutput | BaseException:
        while (output := self.output) is None:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        self.output = None
        return output

    def get_nowait(self) -> RequestOutput | BaseException | None:
        output, self.output = self.output, None
        return output


def _merge_delta(prev: RequestOutput, new: RequestOutput) -> None:
    """Append DELTA output `new` to `prev`, completion by completion (n > 1: by index)."""
    by_index = {c.index: c for c in prev.outputs}
    for completion in new.outputs:
        into = by_index.get(completion.index)
        if into is None:
            prev.outputs.append(completion)
            continue
        into.text += completion.text
        into.token_ids = into.token_ids + completion.token_ids
        if completion.logprobs is not None:
            into.logprobs = (into.logprobs or []) + completion.logprobs
        into.cumulative_logprob = completion.cumulative_logprob
        into.finish_reason = completion.finish_reason
        into.stop_reason = completion.stop_reason
    prev.finished = new.finished
    prev.num_cached_tokens = new.num_cached_tokens
    if not prev.prompt_logprobs:
        prev.prompt_logprobs = new.prompt_logprobs


class RequestState:
    """One engine-core request as the frontend tracks it: its tokens, text and owner."""

    def __init__(
        self,
        request: EngineCoreRequest,
        user_request_id: str,
        prompt_text: str | None,
        tokenizer: Tokenizer | None,
        token_texts: TokenTexts | None,
        parent: ParentRequest | None,
        index: int,
        queue: RequestOutputCollector | None,
        stream_interval: int = 1,
    ) -> None:
        """`stream_interval`: the engine's; the request's own may raise it."""
        params = request.sampling_params
        self.internal_id = request.request_id
        self.user_request_id = user_request_id
        self.prompt_text = prompt_text
        self.prompt_token_ids = request.prompt_token_ids
        self.delta = params.output_kind == RequestOutputKind.DELTA
        self.final_only = params.output_kind == RequestOutputKind.FINAL_ONLY
        self.detokenizer = None
        if tokenizer is not None:
            self.detokenizer = IncrementalDetokenizer(tokenizer, self.prompt_token_ids, params)
        self.parent = parent
        self.index = index
        self.queue = queue  # where AsyncLLM's consumer waits; None: returned to the caller
        self.token_ids: list[int] = []  # all of them; not kept for DELTA
        self.num_cached_tokens = 0
        self.logprobs = None  # unless (prompt) logprobs were asked for
        if params.logprobs is not None or params.prompt_logprobs is not None:
            self.logprobs = RequestLogprobs(params.logprobs, params.prompt_logprobs, token_texts)
        # a new step may extend the output its consumer has not taken yet (`extend_waiting`)
        self.extends = self.delta and parent is None and self.logprobs is None and queue is not None
        # outputs of `stream_interval` new tokens each, the first and the last excepted
        self.stream_interval = max(params.stream_interval or 1, stream_interval)
        self.num_received = 0  # output tokens that have come from the engine-core
        self.num_emitted = 0  # of those, the ones an output has carried
        self.held: list[int] = []  # DELTA: ids received but not yet in an output

    def holds_back(self, finished: bool) -> bool:
        """Whether this step's tokens wait for more before an output carries them."""
        return (
            not finished
            and self.num_emitted > 0
            and self.num_received - self.num_emitted < self.stream_interval
        )

    @property
    def prompt_logprobs(self) -> PromptLogprobs | None:
        """For the next RequestOutput (DELTA: only the first that has them)."""
        return None if self.logprobs is None else self.logprobs.prompt_logprobs(self.delta)

    def extend_waiting(
        self,
        new_token_ids: list[int],
        finish_reason: FinishReason | None,
        stop_reason: int | str | None,
    ) -> bool:
        """A DELTA stream of one completion without logprobs whose consumer has not taken
        the previous output yet: append this step's text and ids to that output, and make
        no new one (what `RequestOutputCollector` would merge). A server that lags behind
        the engine does this for most tokens. False when there is no such output."""
        if not self.extends:
            return False
        waiting = self.queue.output  # type: ignore[union-attr]
        if waiting.__class__ is not RequestOutput:  # taken (None), or an exception
            return False
        completion = waiting.outputs[0]
        finished = finish_reason is not None
        if self.detokenizer is not None:
            completion.text += self.detokenizer.get_next_output_text(finished, True)
        completion.token_ids = completion.token_ids + new_token_ids
        if finished:
            completion.finish_reason, completion.stop_reason = str(finish_reason), stop_reason
        waiting.finished = finished
        waiting.num_cached_tokens = self.num_cached_tokens
        return True

    def completion(
        self,
        new_token_ids: list[int],
        finish_reason: FinishReason | None,
        stop_reason: int | str | None,
    ) -> CompletionOutput | None:
        """This step's view of the completion for the output kind, or None if nothing is due."""
        finished = finish_reason is not None
        if self.final_only and not finished:
            return None
        delta = self.delta
        text = ""
        if self.detokenizer is not None:
            text = self.detokenizer.get_next_output_text(finished, delta)
        logprobs = cumulative = None
        if self.logprobs is not None:
            logprobs = self.logprobs.sample_logprobs(len(new_token_ids) if delta else None)
            cumulative = self.logprobs.cumulative_logprob
        # positional: a dataclass takes keywords at twice the cost, and this runs per token
        return CompletionOutput(
            self.index,
            text,
            # DELTA: the decoded message's own list, which nothing else holds
            new_token_ids if delta else list(self.token_ids),
            cumulative,
            logprobs,
            str(finish_reason) if finished else None,
            stop_reason,
        )


class OutputProcessor:
    """Detokenizes engine-core outputs, applies stop strings and output kinds, merges the
    children of n > 1 requests, and maps internal ids back to the user's request ids.

    Holds no sockets: `process_outputs` returns what to yield and what to abort, and the
    caller (LLMEngine, AsyncLLM) routes them.
    """

    def __init__(self, tokenizer: Tokenizer | None, stream_interval: int = 1) -> None:
        """`stream_interval`: new tokens per streamed output (`ModelConfig.stream_interval`)."""
        self.tokenizer = tokenizer
        self.stream_interval = stream_interval
        self.token_texts = None if tokenizer is None else TokenTexts(tokenizer)
        self.request_states: dict[str, RequestState] = {}  # by internal id
        self.user_requests: dict[str, list[str]] = {}  # user id -> its unfinished internal ids

    def add_user_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        input_processor: InputProcessor,
        arrival_time: float | None = None,
        queue: RequestOutputCollector | None = None,
    ) -> list[EngineCoreRequest]:
        """Validate and register one user request; return the core requests to send
        (n of them when params.n > 1). Raises ValueError for bad input or a running id.
        With a `queue`, its outputs go there instead of into `process_outputs`' result."""
        if request_id in self.user_requests:
            raise ValueError(f"request_id {request_id!r} is already running")
        prompt_text, request = input_processor.process(request_id, prompt, params, arrival_time)
        parent = None
        children = [request]
        if request.sampling_params.n > 1:
            parent = ParentRequest(request.request_id, request.sampling_params)
            children = parent.fan_out(request)
        for index, child in enumerate(children):
            self.request_states[child.request_id] = RequestState(
                child,
                request_id,
                prompt_text,
                self.tokenizer,
                self.token_texts,
                parent,
                index,
                queue,
                self.stream_interval,
            )
        self.user_requests[request_id] = [child.request_id for child in children]
        return children

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        """Turn one step's engine-core outputs into user-facing `RequestOutput`s: put into
        the request's queue if it has one, else returned."""
        result = ProcessedOutputs()
        for out in outputs:
            state = self.request_states.get(out.request_id)
            if state is None:
                continue  # ended here already (stop string, abort); the core's late news
            if out.num_cached_tokens:
                state.num_cached_tokens = out.num_cached_tokens
            finish_reason, stop_reason = out.finish_reason, out.stop_reason
            if finish_reason == FinishReason.ERROR:
                self._fail(state, out.error or "the engine-core reported an error", result)
                continue
            new_token_ids, new_logprobs = out.new_token_ids, out.new_logprobs
            stop_string = None  # the stop string that ended the text, if any
            if state.detokenizer is not None:
                stop_string, num_taken = state.detokenizer.update_tokens(
                    new_token_ids, finish_reason
                )
                if num_taken < len(new_token_ids):  # the rest came after the stop string
                    new_token_ids = new_token_ids[:num_taken]
                    if new_logprobs is not None:
                        new_logprobs = new_logprobs.rows(0, num_taken)
            if state.logprobs is not None:
                state.logprobs.add(new_logprobs, out.new_prompt_logprobs)
            if not state.delta:
                state.token_ids.extend(new_token_ids)
            if stop_string is not None:
                if finish_reason is None:
                    result.reqs_to_abort.append(state.internal_id)
                finish_reason, stop_reason = FinishReason.STOP, stop_string
            state.num_received += len(new_token_ids)
            if state.held:  # (DELTA) what earlier steps held back goes first
                new_token_ids, state.held = state.held + new_token_ids, []
            if state.extend_waiting(new_token_ids, finish_reason, stop_reason):
                state.num_emitted = state.num_received
                if finish_reason is not None:
                    self._forget(state)
                continue
            if state.stream_interval > 1 and state.holds_back(finish_reason is not None):
                if state.delta:
                    state.held = new_token_ids
                continue
            state.num_emitted = state.num_received
            completion = state.completion(new_token_ids, finish_reason, stop_reason)
            if finish_reason is not None:
                self._forget(state)
            if completion is None:
                continue
            request_output = self._request_output(state, completion)
            if request_output is None:
                continue
            if state.queue is not None:
                state.queue.put(request_output)
            else:
                result.request_outputs.append(request_output)
        return result

    def abort_user_requests(self, user_request_ids: list[str]) -> list[str]:
        """Forget these user requests (all n children); return the internal ids to abort in
        the core. No outputs: the user who cancels is not waiting for one."""
        internal_ids = []
        for user_id in user_request_ids:
            for internal_id in self.user_requests.pop(user_id, []):
                self.request_states.pop(internal_id, None)
                internal_ids.append(internal_id)
        return internal_ids

    def forget_lost(self, internal_ids: list[str]) -> list[str]:
        """Forget the user requests these internal ids belong to (an engine-core that held
        them died); return those user ids."""
        states = self.request_states
        users = list(dict.fromkeys(states[r].user_request_id for r in internal_ids if r in states))
        self.abort_user_requests(users)
        return users

    def get_internal_ids(self, user_request_id: str) -> list[str]:
        """The unfinished engine-core ids of a user request."""
        return list(self.user_requests.get(user_request_id, []))

    def get_num_unfinished_requests(self) -> int:
        return len(self.request_states)

    def has_unfinished_requests(self) -> bool:
        return bool(self.request_states)

    def _fail(self, state: RequestState, error: str, result: ProcessedOutputs) -> None:
        """A request failed: end it (and its n > 1 siblings, which the core must drop too)
        with one final 'error' output, and record the error for the caller to raise. The
        output is returned, never queued: the caller raises the error to the consumer."""
        user_id = state.user_request_id
        result.errors[user_id] = error
        for internal_id in self.user_requests.get(user_id, []):
            if internal_id != state.internal_id:
                result.reqs_to_abort.append(internal_id)
        self.abort_user_requests([user_id])
        completion = state.completion(state.held, FinishReason.ERROR, None)
        result.request_outputs.append(
            self._make_request_output(state, [completion] if completion else [], True)
        )

    def _forget(self, state: RequestState) -> None:
        self.request_states.pop(state.internal_id, None)
        siblings = self.user_requests.get(state.user_request_id)
        if siblings is not None:
            siblings.remove(state.internal_id)
            if not siblings:
                del self.user_requests[state.user_request_id]

    def _request_output(
        self, state: RequestState, completion: CompletionOutput
    ) -> RequestOutput | None:
        """The user's request after this completion; None while n > 1 siblings are due."""
        parent = state.parent
        if parent is None:
            return self._make_request_output(state, [completion], completion.finished())
        completions = parent.add_child_output(completion)
        if completions is None:
            return None
        return self._make_request_output(state, completions, parent.finished)

    @staticmethod
    def _make_request_output(
        state: RequestState, completions: list[CompletionOutput], finished: bool
    ) -> RequestOutput:
        return RequestOutput(
            state.user_request_id,
            state.prompt_text,
            state.prompt_token_ids,
            completions,
            finished,
            state.num_cached_tokens,
            None,
            state.prompt_logprobs,
        )
