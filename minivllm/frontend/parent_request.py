"""`n > 1`: one user request fans out into n engine-core requests, merged back on output."""

from __future__ import annotations

import msgspec

from minivllm.outputs import CompletionOutput
from minivllm.protocol.messages import EngineCoreRequest
from minivllm.protocol.sampling_params import RequestOutputKind, SamplingParams


class ParentRequest:
    """The n completions of one user request, as seen by the frontend.

    The engine-core only knows the children (each with n=1); their ids derive from the
    parent's unique internal id, so they are unique too. Without a seed every child samples
    independently; with one, child i uses seed + i so the n samples differ but repeat.
    """

    def __init__(self, internal_id: str, params: SamplingParams) -> None:
        self.internal_id = internal_id
        self.params = params
        self.outputs = [CompletionOutput(index=i, text="", token_ids=[]) for i in range(params.n)]
        self.unfinished = set(range(params.n))

    def child_id(self, index: int) -> str:
        return f"{index}_{self.internal_id}"

    def fan_out(self, request: EngineCoreRequest) -> list[EngineCoreRequest]:
        """The n core requests to send, in index order."""
        children = []
        for i in range(self.params.n):
            seed = None if self.params.seed is None else self.params.seed + i
            params = msgspec.structs.replace(request.sampling_params, n=1, seed=seed)
            children.append(
                msgspec.structs.replace(
                    request, request_id=self.child_id(i), sampling_params=params
                )
            )
        return children

    def add_child_output(self, output: CompletionOutput) -> list[CompletionOutput] | None:
        """Record one child's new output; return the completions to emit now, or None.

        DELTA emits just the updated child; CUMULATIVE all n as they stand; FINAL_ONLY all n,
        once, when the last child finishes.
        """
        kind = self.params.output_kind
        if kind != RequestOutputKind.DELTA:
            self.outputs[output.index] = output
        if output.finished():
            self.unfinished.discard(output.index)
        if kind == RequestOutputKind.DELTA:
            return [output]
        if kind == RequestOutputKind.FINAL_ONLY and self.unfinished:
            return None
        return list(self.outputs)

    @property
    def finished(self) -> bool:
        return not self.unfinished
