"""The logprobs that ride on a request's outputs: those of its new tokens, and, with its
first token, those of its whole prompt (gathered over the prefill chunks that computed them)."""

from __future__ import annotations

from collections.abc import Container

from minivllm.engine_core.request import Request
from minivllm.protocol.messages import EngineCoreOutput, LogprobsArrays, ModelRunnerOutput


def needs_prompt_logprobs(request: Request) -> bool:
    """Prompt logprobs still to compute: the whole prompt runs, none of it from the cache."""
    return request.sampling_params.prompt_logprobs is not None and not request.output_token_ids


class OutputLogprobs:
    def __init__(self) -> None:
        # req_id -> prompt logprobs received so far, sent with the request's first token
        self.prompt_parts: dict[str, list[LogprobsArrays]] = {}

    def attach(
        self,
        outputs: list[list[EngineCoreOutput]],
        runner: ModelRunnerOutput,
        unfinished: Container[str],
    ) -> None:
        """Give each of a step's outputs (by client) its logprobs. A request's rows in
        `runner.logprobs` are one per token it sampled, after those of the requests before
        it; an output whose tokens a stop cut short takes the first of its rows."""
        for req_id, part in runner.prompt_logprobs.items():
            self.prompt_parts.setdefault(req_id, []).append(part)
        rows, start = {}, 0
        for i in runner.logprobs_req_idx:
            rows[runner.req_ids[i]] = start
            start += len(runner.sampled_token_ids[i])
        for client_outputs in outputs:
            for out in client_outputs:
                row = rows.get(out.request_id)
                if row is not None and out.new_token_ids:
                    out.new_logprobs = runner.logprobs.rows(row, row + len(out.new_token_ids))
                if out.new_token_ids and (parts := self.prompt_parts.pop(out.request_id, None)):
                    out.new_prompt_logprobs = LogprobsArrays.concat(parts)
        for req_id in runner.prompt_logprobs:
            if req_id not in unfinished:  # ended while this step ran
                self.prompt_parts.pop(req_id, None)

    def drop(self, request_id: str) -> None:
        """Forget the prompt logprobs gathered for a request (ended, or to be recomputed)."""
        self.prompt_parts.pop(request_id, None)
