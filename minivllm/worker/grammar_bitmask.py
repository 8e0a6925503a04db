"""The worker's side of structured outputs: a step's grammar bitmask, staged to the device.

A step with structured outputs is two messages: its `SchedulerOutput`, whose forward and LM
head `ModelRunner.execute_model` launches, then its `GrammarBitmask`, which the engine-core
fills meanwhile and `ModelRunner.sample_tokens` gets: it checks the bitmask against the
step, copies its rows through a pinned buffer (`GrammarBitmasks.stage_step`) and has the
sampler apply them before any other logits processing. Steps without structured outputs
never get here.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from minivllm.protocol.messages import GrammarBitmask


@dataclass
class GrammarMask:
    """A step's bitmask on the device, and the sampling rows it constrains."""

    bitmask: torch.Tensor  # int32 [K, W]
    rows: torch.Tensor  # int64 [K]: indices into the step's sampling rows


class GrammarBitmasks:
    """Pinned host buffers (two, used in turn, as in `StepBuffers`) and a device buffer for
    up to `max_rows` bitmask rows of a `vocab_size` vocabulary."""

    def __init__(self, max_rows: int, vocab_size: int, device: torch.device) -> None:
        self.num_words = -(-vocab_size // 32)
        self.device = device
        self.on_cuda = device.type == "cuda"
        self._host: list[tuple[torch.Tensor, torch.Tensor]] = []
        for _ in range(2 if self.on_cuda else 1):
            mask = torch.empty(max_rows, self.num_words, dtype=torch.int32, pin_memory=self.on_cuda)
            rows = torch.empty(max_rows, dtype=torch.int64, pin_memory=self.on_cuda)
            self._host.append((mask, rows))
        self._copied: list[torch.cuda.Event | None] = [None] * len(self._host)
        self._current = 0
        if self.on_cuda:
            self._dev_mask = torch.empty(max_rows, self.num_words, dtype=torch.int32, device=device)
            self._dev_rows = torch.empty(max_rows, dtype=torch.int64, device=device)

    def stage_step(
        self,
        msg: GrammarBitmask,
        step_id: int,
        req_ids: list[str],
        sample_rows: dict[str, tuple[int, int]],
    ) -> GrammarMask:
        """Stage the bitmask of step `step_id` for its structured-output requests `req_ids`,
        each with its (first sampling row, number of rows) in `sample_rows` and as many
        bitmask rows; RuntimeError if `msg` does not fit that step."""
        bitmask = msg.bitmask
        try:
            spans = [sample_rows[r] for r in req_ids]
        except KeyError as e:
            raise RuntimeError(f"request {e} has a grammar bitmask but does not sample") from e
        expected = (sum(c for _, c in spans), self.num_words)
        if msg.step_id != step_id or bitmask.shape != expected or bitmask.dtype != np.int32:
            raise RuntimeError(
                f"grammar bitmask of step {msg.step_id}, {bitmask.dtype} {bitmask.shape}, "
                f"for step {step_id} with {expected[0]} constrained rows of "
                f"{self.num_words} int32 words"
            )
        rows = [row for first, count in spans for row in range(first, first + count)]
        return self.stage(bitmask, np.array(rows, dtype=np.int64))

    def stage(self, bitmask: np.ndarray, rows: np.ndarray) -> GrammarMask:
        """Copy `bitmask` [K, W] and its sampling `rows` [K] to the device, without waiting
        for the stream."""
        k = len(rows)
        if self.on_cuda:
            self._current ^= 1
            event = self._copied[self._current]
            if event is not None:
                event.synchronize()  # that buffer's last copy has left it
        host_mask, host_rows = self._host[self._current]
        host_mask[:k].numpy()[...] = bitmask
        host_rows[:k].numpy()[...] = rows
        if not self.on_cuda:
            return GrammarMask(host_mask[:k], host_rows[:k])
        mask, dev_rows = self._dev_mask[:k], self._dev_rows[:k]
        mask.copy_(host_mask[:k], non_blocking=True)
        dev_rows.copy_(host_rows[:k], non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._copied[self._current] = event
        return GrammarMask(mask, dev_rows)
