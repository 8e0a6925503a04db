"""A step's output while its sampled ids may still be on their way from the device.

The runner copies the sampled ids (and any logprobs) into pinned memory with non_blocking
copies and records an event; `get()` waits for that event and builds the
`ModelRunnerOutput`. The worker process calls `get()` on its sender thread, so its main
thread can launch the next step meanwhile.
"""

from __future__ import annotations

import threading

import torch

from minivllm.protocol.messages import LogprobsArrays, ModelRunnerOutput
from minivllm.worker.sampler import LogprobsTensors, SamplerOutput


class AsyncModelRunnerOutput:
    def __init__(
        self,
        step_id: int,
        req_ids: list[str],
        sample_idx: list[int],
        result: SamplerOutput | None,
        prompt_logprobs: dict[str, LogprobsTensors] | None = None,
    ) -> None:
        """result: the sampler's output on the device for the requests at sample_idx;
        prompt_logprobs: by request id."""
        self.step_id = step_id
        self.req_ids = req_ids
        self.sample_idx = sample_idx
        # stays alive: the next step may gather its input ids from it
        self.sampled = sampled = None if result is None else result.sampled
        logprobs = None if result is None else result.logprobs
        self.logprobs_req_idx = []
        if logprobs is not None:
            rows = result.logprobs_rows
            self.logprobs_req_idx = sample_idx if rows is None else [sample_idx[j] for j in rows]
        self._event: torch.cuda.Event | None = None
        self._host = _to_host(sampled)
        self._logprobs = None if logprobs is None else tuple(map(_to_host, logprobs))
        prompt_logprobs = prompt_logprobs or {}
        self._prompt_logprobs = {r: tuple(map(_to_host, t)) for r, t in prompt_logprobs.items()}
        copied = [sampled, *(logprobs or ()), *(t[0] for t in prompt_logprobs.values())]
        if any(t is not None and t.is_cuda for t in copied):
            self._event = torch.cuda.Event()
            self._event.record()
        self._tokens: list[int] | None = None
        self._lock = threading.Lock()  # the sender thread and the main thread both read it

    def token_ids(self) -> list[int]:
        """The sampled ids, in sample_idx order (waits for the device copy)."""
        with self._lock:
            if self._tokens is None:
                if self._event is not None:
                    self._event.synchronize()
                self._tokens = [] if self._host is None else self._host.tolist()
            return self._tokens

    def get(self) -> ModelRunnerOutput:
        tokens = self.token_ids()
        if len(tokens) == len(self.req_ids):  # every request sampled (pure decode)
            sampled = [[t] for t in tokens]
        else:
            sampled = [[] for _ in self.req_ids]
            for i, t in zip(self.sample_idx, tokens, strict=True):
                sampled[i] = [t]
        return ModelRunnerOutput(
            step_id=self.step_id,
            req_ids=self.req_ids,
            sampled_token_ids=sampled,
            logprobs=None if self._logprobs is None else _arrays(self._logprobs),
            logprobs_req_idx=self.logprobs_req_idx,
            prompt_logprobs={r: _arrays(t) for r, t in self._prompt_logprobs.items()},
        )


def _to_host(t: torch.Tensor | None) -> torch.Tensor | None:
    """A pinned host copy of a device tensor, started without waiting (the event after all
    of a step's copies says when they are done); host tensors as they are."""
    if t is None or not t.is_cuda:
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t, non_blocking=True)


def _arrays(t: LogprobsTensors) -> LogprobsArrays:
    ids, logprobs, ranks = (x.numpy() for x in t)
    return LogprobsArrays(ids, logprobs, ranks)
