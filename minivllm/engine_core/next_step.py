"""The step `Scheduler.schedule` is filling: its token budget, what it hands each request,
and the scheduler output's parts that follow from that. Both of the scheduler's loops
(running requests, then waiting ones) end each request they schedule with `take`, the one
tail they share."""

from __future__ import annotations

from dataclasses import dataclass, field

from minivllm.engine_core.request import Request
from minivllm.protocol.messages import CachedRequestData, NewRequestData


@dataclass(slots=True)
class NextStep:
    """The step `Scheduler.schedule` is filling."""

    budget: int  # tokens left to hand out
    num_scheduled: dict[str, int] = field(default_factory=dict)
    cached_reqs: CachedRequestData = field(default_factory=CachedRequestData)
    new_reqs: list[NewRequestData] = field(default_factory=list)
    structured: list[str] = field(default_factory=list)  # sample under a grammar
    spec_tokens: dict[str, list[int]] = field(default_factory=dict)  # drafts verified
    preempted: bool = False

    def take(self, request: Request, num_new: int) -> None:
        """Schedule `num_new` more tokens of `request` (its drafts among them, see
        `take_drafts`); one whose known tokens all have KV after this step samples its next
        token (or verifies its drafts) in it."""
        self.num_scheduled[request.request_id] = num_new
        self.budget -= num_new
        request.num_computed_tokens += num_new
        if request.num_computed_tokens >= len(request.all_token_ids):
            request.num_output_placeholders += 1
            grammar = request.structured_output
            if grammar is not None and grammar.active:
                self.structured.append(request.request_id)

    def take_drafts(self, request: Request, num_drafts: int) -> None:
        """Of the tokens `take` schedules next for a running request, the last `num_drafts`
        are its first draft tokens, for this step to verify; the drafts the budget cut are
        dropped. (A waiting request has no drafts: they are dropped when it is preempted.)"""
        if num_drafts:
            self.spec_tokens[request.request_id] = request.spec_token_ids[:num_drafts]
            request.num_drafts_in_flight = num_drafts
        request.spec_token_ids = []
