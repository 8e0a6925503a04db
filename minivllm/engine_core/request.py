"""Engine-internal state of one request, owned by the scheduler."""

from __future__ import annotations

import enum
import hashlib
import time

from minivllm.protocol.messages import (
    EngineCoreEvent,
    EngineCoreEventType,
    EngineCoreRequest,
    FinishReason,
)
from minivllm.protocol.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2  # back in the waiting queue, KV freed, to be recomputed
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


def derive_seed(engine_seed: int, request_id: str) -> int:
    """A per-request seed from the engine seed and the (engine-unique) request id."""
    digest = hashlib.sha256(f"{engine_seed}:{request_id}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class Request:
    """One request as the scheduler sees it.

    Token accounting: `all_token_ids` holds the prompt and every output token received so
    far. `num_computed_tokens` counts positions whose KV is computed or being computed by a
    step already scheduled. `num_output_placeholders` counts tokens that scheduled steps will
    sample but whose ids have not arrived yet (async scheduling), so the next position to
    schedule is `num_tokens + num_output_placeholders`.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: list[int] | None = None,
        arrival_time: float = 0.0,
        client_id: int = 0,
        sample_seed: int | None = None,
    ) -> None:
        self.request_id = request_id
        self.client_id = client_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.sampling_params = sampling_params
        eos = frozenset(eos_token_ids or ())
        stops = frozenset(sampling_params.stop_token_ids or ())
        # The tokens that end the text, computed here only: EOS and the stop token ids. A
        # structured output's grammar ends at one of them, and min_tokens masks them all
        # until it is reached (EOS too, whatever ignore_eos says, as in vLLM).
        self.stop_token_ids: frozenset[int] = eos | stops
        # Those that end the request (after min_tokens), and its stop reason: a stop token
        # id is its own, EOS has none; ignore_eos keeps EOS from ending it (unless it is
        # also a stop token id).
        self.stop_reasons: dict[int, int | None] = {token_id: token_id for token_id in stops}
        if not sampling_params.ignore_eos:
            self.stop_reasons.update(dict.fromkeys(eos))
        self.max_num_tokens = 0  # tokens (prompt + output) at which it ends by length: set on add
        self.arrival_time = arrival_time
        self.num_computed_tokens = 0
        self.num_output_placeholders = 0
        self.num_cached_tokens = -1  # prompt tokens hit in the prefix cache, first schedule
        self.stop_reason: int | str | None = None
        self.status = RequestStatus.WAITING
        if sampling_params.seed is not None:
            sample_seed = sampling_params.seed
        self.sample_seed = sample_seed if sample_seed is not None else derive_seed(0, request_id)
        self.block_hashes: list[bytes] = []  # chained hashes of full blocks, see KVCacheManager
        # rotated with LongRoPE's long factors (SchedulerConfig.long_rope_threshold): set when
        # it is scheduled from the waiting queue; its blocks hash apart
        self.long_rope = False
        # its grammar and matcher (StructuredOutputRequest), if it has structured outputs
        self.structured_output = None
        self.events: list[EngineCoreEvent] = []  # not yet sent; ride on its next output
        self.spec_token_ids: list[int] = []  # drafts for its next step
        self.spec_wanted = False  # drafts were proposed while a step was in flight: wait for it
        self.num_drafts_in_flight = 0  # drafts the step in flight verifies

    @classmethod
    def from_engine_core_request(cls, req: EngineCoreRequest, engine_seed: int = 0) -> Request:
        """Without a user seed, the sample seed is derived from `engine_seed` and the id. A
        continuation's output so far becomes its output, as a preempted request keeps its
        own: computed again with the prompt before the next token is sampled."""
        request = cls(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            sampling_params=req.sampling_params,
            eos_token_ids=req.eos_token_ids,
            arrival_time=req.arrival_time,
            client_id=req.client_id,
            sample_seed=derive_seed(engine_seed, req.request_id),
        )
        if req.output_token_ids:
            request.output_token_ids = list(req.output_token_ids)
            request.all_token_ids.extend(req.output_token_ids)
        return request

    def record_event(self, event_type: EngineCoreEventType) -> None:
        self.events.append(EngineCoreEvent(event_type, time.time()))

    def take_events(self) -> list[EngineCoreEvent]:
        events, self.events = self.events, []
        return events

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, placeholders={self.num_output_placeholders})"
        )
