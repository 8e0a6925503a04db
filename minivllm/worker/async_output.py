"""A step's output while its sampled ids may still be on their way from the device.

The runner copies the sampled ids (and any logprobs) into pinned memory with non_blocking
copies and records an event; `get()` waits for that event and builds the
`ModelRunnerOutput`. The worker process calls `get()` on its sender thread, so its main
thread can launch the next step meanwhile.

A step that verified draft tokens returns a table of each sampling request's tokens and
their counts; its logprobs rows (one per sampled row) are cut to the tokens kept here, on
the host, where the counts are known.
"""

from __future__ import annotations

import threading

import numpy as np
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
        num_rows: np.ndarray | None = None,
        draft_token_ids: torch.Tensor | None = None,
    ) -> None:
        """result: the sampler's output on the device for the requests at sample_idx (each
        of `num_rows` sampling rows, one by default); prompt_logprobs: by request id;
        draft_token_ids [len(sample_idx), k]: the draft model's proposals."""
        self.step_id = step_id
        self.req_ids = req_ids
        self.sample_idx = sample_idx
        # stays alive: the next step may gather its input ids from it
        self.sampled = sampled = None if result is None else result.sampled
        verified = None if result is None else result.verified
        logprobs = None if result is None else result.logprobs
        self._num_rows = num_rows
        self._logprobs_rows = None if result is None else result.logprobs_rows
        self._event: torch.cuda.Event | None = None
        if verified is None:
            self._host = _to_host(sampled)
            self._num_tokens = None
        else:
            self._host = _to_host(verified.tokens)
            self._num_tokens = _to_host(verified.num_tokens)
        self._logprobs = None if logprobs is None else tuple(map(_to_host, logprobs))
        self._drafts = _to_host(draft_token_ids)
        prompt_logprobs = prompt_logprobs or {}
        self._prompt_logprobs = {r: tuple(map(_to_host, t)) for r, t in prompt_logprobs.items()}
        copied = [sampled, draft_token_ids, *(logprobs or ())]
        copied += [t[0] for t in prompt_logprobs.values()]
        if any(t is not None and t.is_cuda for t in copied):
            self._event = torch.cuda.Event()
            self._event.record()
        self._tokens: list[list[int]] | None = None
        self._lock = threading.Lock()  # the sender thread and the main thread both read it

    def token_ids(self) -> list[list[int]]:
        """The sampled ids of each sampling request, in sample_idx order (waits for the
        device copy)."""
        with self._lock:
            if self._tokens is None:
                if self._event is not None:
                    self._event.synchronize()
                if self._host is None:
                    self._tokens = []
                elif self._num_tokens is None:
                    self._tokens = [[t] for t in self._host.tolist()]
                else:
                    table, counts = self._host.tolist(), self._num_tokens.tolist()
                    self._tokens = [row[:c] for row, c in zip(table, counts, strict=True)]
            return self._tokens

    def get(self) -> ModelRunnerOutput:
        tokens = self.token_ids()
        if len(tokens) == len(self.req_ids):  # every request sampled (pure decode)
            sampled = tokens
        else:
            sampled = [[] for _ in self.req_ids]
            for i, t in zip(self.sample_idx, tokens, strict=True):
                sampled[i] = t
        logprobs, logprobs_req_idx = None, []
        if self._logprobs is not None:
            logprobs, logprobs_req_idx = self._kept_logprobs(tokens)
        drafts = []
        if self._drafts is not None:
            drafts = [[] for _ in self.req_ids]
            for i, d in zip(self.sample_idx, self._drafts.tolist(), strict=True):
                drafts[i] = d
        return ModelRunnerOutput(
            step_id=self.step_id,
            req_ids=self.req_ids,
            sampled_token_ids=sampled,
            logprobs=logprobs,
            logprobs_req_idx=logprobs_req_idx,
            prompt_logprobs={r: _arrays(t) for r, t in self._prompt_logprobs.items()},
            draft_token_ids=drafts,
        )

    def _kept_logprobs(self, tokens: list[list[int]]) -> tuple[LogprobsArrays, list[int]]:
        """The logprobs rows of the tokens returned, and the requests they belong to (those
        that asked, each once, as indices into req_ids)."""
        arrays = _arrays(self._logprobs)
        num_rows = self._num_rows
        if num_rows is None:  # a row per sampling request
            owners = np.arange(len(tokens))
        else:
            owners = np.repeat(np.arange(len(num_rows)), num_rows)
        asked = self._logprobs_rows
        if asked is not None:
            owners = owners[asked]
        if num_rows is not None and len(owners):
            firsts = np.cumsum(num_rows) - num_rows
            rows = asked if asked is not None else np.arange(len(owners))
            counts = np.fromiter(map(len, tokens), np.int64, len(tokens))
            kept = np.asarray(rows) - firsts[owners] < counts[owners]
            arrays = LogprobsArrays(
                arrays.token_ids[kept], arrays.logprobs[kept], arrays.ranks[kept]
            )
            owners = owners[kept]
        unique = owners[np.r_[True, owners[1:] != owners[:-1]]] if len(owners) else owners
        return arrays, [self.sample_idx[j] for j in unique.tolist()]


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
