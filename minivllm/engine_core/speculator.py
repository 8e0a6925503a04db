"""The scheduler's side of speculative decoding: each running request's draft tokens for its
next step, and vLLM's acceptance counters.

After a step's tokens are appended to a request, `propose` gives it the drafts its next step
verifies: the n-gram proposer's (engine_core/ngram_proposer.py), or those the draft model
proposed in the worker right after sampling (`ModelRunnerOutput.draft_token_ids`), cut to
what `max_tokens` leaves and to the prefix its grammar allows. A sequence still rotated short
(LongRoPE) takes none past the threshold: the scheduler recomputes it long once its known
tokens cross it, and the drafts' KV would be rotated short.

With async scheduling the next step of a request may be scheduled before its last one's
tokens are back. A step that verifies drafts returns an unknown number of them, so nothing
more of that request is scheduled until it has (the engine-core waits for it); and drafts
proposed while another step of the request is already in flight are stale by then, so such a
request waits for that step too (`Request.spec_wanted`), and verifies fresh drafts after it.
A request whose proposer finds nothing (no n-gram match) keeps decoding one token a step,
scheduled ahead as without speculation.
"""

from __future__ import annotations

from minivllm.engine_core.ngram_proposer import NgramProposer
from minivllm.engine_core.request import Request
from minivllm.protocol.messages import SchedulerStats
from minivllm.speculative_config import SpeculativeConfig


class Speculator:
    def __init__(self, config: SpeculativeConfig, long_rope_threshold: int | None = None) -> None:
        self.k = config.num_speculative_tokens
        # a short LongRoPE sequence verifies no draft past this (its KV would rotate short)
        self.long_rope_threshold = long_rope_threshold
        self.num_lookahead_tokens = config.num_lookahead_tokens
        self.ngram = None
        if config.method == "ngram":
            self.ngram = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        # vLLM's spec decoding stats, cumulative
        self.num_drafts = 0  # verifications: a request's step that carried drafts
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_accepted_tokens_per_pos = [0] * self.k

    def propose(self, request: Request, worker_drafts: list[int]) -> None:
        """Set the drafts of a running request whose newest tokens were just appended."""
        # every output must fit max_tokens (and the context: max_num_tokens is within it)
        cap = min(self.k, request.max_num_tokens - request.num_tokens - 1)
        threshold = self.long_rope_threshold
        if threshold is not None and not request.long_rope:
            cap = min(cap, threshold - request.num_tokens)
        drafts: list[int] = []
        if cap > 0:
            if self.ngram is not None:
                drafts = self.ngram.propose(request.request_id, request.all_token_ids, cap)
            else:
                drafts = worker_drafts[:cap]
        if request.num_output_placeholders:
            # a step of it is in flight: these drafts are stale by then; if there are any,
            # wait for that step and verify fresh ones after it
            request.spec_token_ids, request.spec_wanted = [], bool(drafts)
            return
        grammar = request.structured_output
        if drafts and grammar is not None and grammar.active:
            drafts = grammar.validate(drafts)
        request.spec_token_ids, request.spec_wanted = drafts, False

    def verified(self, num_drafts: int, num_sampled: int) -> int:
        """A step verified `num_drafts` drafts of a request and returned `num_sampled`
        tokens (the accepted drafts and one more); returns how many drafts were rejected."""
        num_accepted = num_sampled - 1
        assert 0 <= num_accepted <= num_drafts, (num_accepted, num_drafts)
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            self.num_accepted_tokens_per_pos[pos] += 1
        return num_drafts - num_accepted

    def fill_stats(self, stats: SchedulerStats) -> None:
        stats.spec_num_drafts = self.num_drafts
        stats.spec_num_draft_tokens = self.num_draft_tokens
        stats.spec_num_accepted_tokens = self.num_accepted_tokens
        stats.spec_num_accepted_tokens_per_pos = list(self.num_accepted_tokens_per_pos)

    def forget(self, request_id: str) -> None:
        if self.ngram is not None:
            self.ngram.forget(request_id)
