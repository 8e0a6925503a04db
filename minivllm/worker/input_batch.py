"""The worker's persistent view of the running requests.

Each request owns one row of preallocated buffers (token ids, block table, sampling
parameters) from the step it arrives until it finishes or is preempted. The scheduler's diffs
update rows in place; a step gathers the rows it needs with numpy indexing, so no tensor is
built from Python lists on the hot path.

A sampled token is counted in `num_tokens` when its step is launched, but its id reaches the
host (`num_host_tokens`) only when the step's output has been copied back: until then the
next step reads it from the device (the runner's in-flight gather).

A step that verifies draft tokens writes them after the request's tokens (where the accepted
ones stay) and returns an unknown number of tokens: its request's `num_tokens` is settled by
the scheduler's next diff for it (the engine-core schedules nothing more of the request
before it has the step's tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from minivllm.protocol.messages import CachedRequestData, NewRequestData
from minivllm.protocol.sampling_params import SamplingParams

NO_LOGPROBS = -2  # InputBatch.num_logprobs of a request that asked for none


@dataclass
class RequestState:
    req_id: str
    row: int
    num_prompt_tokens: int
    num_tokens: int  # prompt + sampled tokens, including one still in flight on the device
    num_host_tokens: int  # of those, the ones whose ids are in InputBatch.token_ids
    num_computed_tokens: int
    num_blocks: int
    params: SamplingParams
    last_sample: tuple[object, int] | None = None  # (step output, row in its sampled ids)
    unsettled: bool = False  # a step verified drafts of it: num_tokens waits for the next diff


class InputBatch:
    def __init__(
        self,
        max_num_reqs: int,
        max_model_len: int,
        max_blocks_per_req: int,
        long_rope_threshold: int | None = None,
    ) -> None:
        self.max_num_reqs = max_num_reqs
        self.long_rope_threshold = long_rope_threshold
        self.max_model_len = max_model_len
        self.token_ids = np.zeros((max_num_reqs, max_model_len + 1), dtype=np.int64)
        self.block_table = np.zeros((max_num_reqs, max_blocks_per_req), dtype=np.int32)
        self.temperature = np.ones(max_num_reqs, dtype=np.float32)
        self.top_k = np.zeros(max_num_reqs, dtype=np.int32)
        self.top_p = np.ones(max_num_reqs, dtype=np.float32)
        self.min_p = np.zeros(max_num_reqs, dtype=np.float32)
        self.seeds = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_logprobs = np.full(max_num_reqs, NO_LOGPROBS, dtype=np.int64)  # -1: all
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        # added to each token's position to find its row of the rotary table: LongRoPE's
        # long rows follow the short ones, for requests sent longer than the threshold (the
        # scheduler decides the same way: SchedulerConfig.long_rope_threshold)
        self.rope_row_offset = np.zeros(max_num_reqs, dtype=np.int64)
        self.requests: dict[str, RequestState] = {}
        self.num_with_logprobs = 0  # requests that asked for logprobs
        self.num_prompt_logprobs = 0  # requests that asked for prompt logprobs
        self._free_rows = list(range(max_num_reqs - 1, -1, -1))

    def add(self, new: NewRequestData) -> RequestState:
        if new.req_id in self.requests:
            self.remove(new.req_id)
        row = self._free_rows.pop()
        n = len(new.token_ids)
        self.token_ids[row, :n] = new.token_ids
        self.block_table[row, : len(new.block_ids)] = new.block_ids
        p = new.sampling_params
        for name in ("temperature", "top_k", "top_p", "min_p"):
            getattr(self, name)[row] = getattr(p, name)
        self.seeds[row] = new.sample_seed
        self.num_logprobs[row] = NO_LOGPROBS if p.logprobs is None else p.logprobs
        self.num_prompt_tokens[row] = new.num_prompt_tokens
        threshold = self.long_rope_threshold
        self.rope_row_offset[row] = threshold if threshold is not None and n > threshold else 0
        state = RequestState(
            req_id=new.req_id,
            row=row,
            num_prompt_tokens=new.num_prompt_tokens,
            num_tokens=n,
            num_host_tokens=n,
            num_computed_tokens=new.num_computed_tokens,
            num_blocks=len(new.block_ids),
            params=p,
        )
        self.requests[new.req_id] = state
        self.num_with_logprobs += p.logprobs is not None
        self.num_prompt_logprobs += p.prompt_logprobs is not None
        return state

    def update(self, cached: CachedRequestData) -> None:
        for req_id, new_blocks, num_computed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens, strict=True
        ):
            state = self.requests[req_id]
            if new_blocks:
                end = state.num_blocks + len(new_blocks)
                self.block_table[state.row, state.num_blocks : end] = new_blocks
                state.num_blocks = end
            state.num_computed_tokens = num_computed
            if state.unsettled:  # every token but the last one has KV: a decode's state
                state.num_tokens = num_computed + 1
                state.unsettled = False

    def write_drafts(self, state: RequestState, draft_ids: list[int]) -> None:
        """Put a step's draft tokens after the request's tokens (the step's input ids)."""
        self.token_ids[state.row, state.num_tokens : state.num_tokens + len(draft_ids)] = draft_ids

    def remove(self, req_id: str) -> RequestState | None:
        state = self.requests.pop(req_id, None)
        if state is not None:
            self._free_rows.append(state.row)
            self.num_with_logprobs -= state.params.logprobs is not None
            self.num_prompt_logprobs -= state.params.prompt_logprobs is not None
        return state

    def append_host_token(self, state: RequestState, token_id: int) -> None:
        """The id of the oldest in-flight token of `state` has arrived on the host."""
        if state.num_host_tokens <= self.max_model_len:
            self.token_ids[state.row, state.num_host_tokens] = token_id
        state.num_host_tokens += 1
