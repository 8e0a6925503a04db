"""A step's output while its sampled ids may still be on their way from the device.

The runner copies the sampled ids into pinned memory with a non_blocking copy and records an
event; `get()` waits for that event and builds the `ModelRunnerOutput`. The worker process
calls `get()` on its sender thread, so its main thread can launch the next step meanwhile.
"""

from __future__ import annotations

import threading

import torch

from minivllm.protocol.messages import ModelRunnerOutput


class AsyncModelRunnerOutput:
    def __init__(
        self,
        step_id: int,
        req_ids: list[str],
        sample_idx: list[int],
        sampled: torch.Tensor | None,
    ) -> None:
        """sampled: the ids [len(sample_idx)] on the device, for requests at sample_idx."""
        self.step_id = step_id
        self.req_ids = req_ids
        self.sample_idx = sample_idx
        self.sampled = sampled  # stays alive: the next step may gather its input ids from it
        self._event: torch.cuda.Event | None = None
        self._host = sampled
        if sampled is not None and sampled.is_cuda:
            self._host = torch.empty(sampled.shape, dtype=sampled.dtype, pin_memory=True)
            self._host.copy_(sampled, non_blocking=True)
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
            step_id=self.step_id, req_ids=self.req_ids, sampled_token_ids=sampled
        )
