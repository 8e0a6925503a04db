"""vLLM's logits processing, batched over requests with different settings.

`LogitsProcessors` keeps each request's settings by its row of the persistent batch, from the
step it arrives until it leaves: allowed token ids (a device mask row), bad words, min_tokens
(with the stop ids it masks), logit bias, and the penalties, whose state lives on the device
(output-token counts, updated from the sampled ids without a host round trip, and a prompt
mask). Each step `prepare` turns the settings of the rows that sample into a `StepProcessing`
(nothing at all when no row uses any of them), which the sampler applies in vLLM's order:

    allowed token ids -> bad words -> min_tokens -> logit bias -> penalties

(a grammar's token bitmask would go first). Every step is -inf masks or additions on
float32 logits, run only when some row of the step uses it.

A step verifying draft tokens samples a row per position after the request's last token
and each draft: row j's output so far ends with the first j drafts. Its length (min_tokens)
and its tokens (bad words: the drafts are in the host's token ids) are the row's; the
penalties count the drafts too, as a correction at the few (row, draft token) pairs on top
of the request's device counts (`DraftPenalties`).

Bad words ban the last token of a word whose other tokens end the output. The host knows
every output token but the newest, which may still be on the device (async scheduling): it
matches all but the last token of the prefix and leaves that one to the device, which
compares it with the row's last input token.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from minivllm.protocol.sampling_params import SamplingParams
from minivllm.worker.input_batch import InputBatch
from minivllm.worker.ops.penalties import apply_penalties
from minivllm.worker.step_buffers import DeviceViews, HostViews


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on the device without waiting for the stream (through pinned memory)."""
    tensor = torch.from_numpy(array)
    if device.type != "cuda":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


@dataclass
class Penalties:
    """The step's penalty inputs, [N] per sampling row, and the per-request device state."""

    batch_rows: torch.Tensor
    repetition: torch.Tensor
    frequency: torch.Tensor
    presence: torch.Tensor
    output_counts: torch.Tensor  # int32 [max requests, V]
    prompt_mask: torch.Tensor  # bool [max requests, V]


@dataclass
class DraftPenalties:
    """Penalty counts that verification rows add for the drafts before them: each (sampling
    row, token) pair once, with how many of its drafts are that token."""

    rows: torch.Tensor  # int64 [P]
    tokens: torch.Tensor  # int64 [P]
    extra: torch.Tensor  # int32 [P]

    def gather(self, logits: torch.Tensor) -> torch.Tensor:
        return logits[self.rows, self.tokens].float()

    def correct(self, processed: torch.Tensor, before: torch.Tensor, p: Penalties) -> None:
        """Write over the pairs of `processed` their penalized values with the extra
        counts, from their values `before` the penalties."""
        rows, tokens = self.rows, self.tokens
        batch_rows = p.batch_rows[rows]
        count = p.output_counts[batch_rows, tokens] + self.extra  # > 0
        repetition = p.repetition[rows]
        x = before * torch.where(before > 0, 1.0 / repetition, repetition)
        x = x - p.frequency[rows] * count - p.presence[rows]
        processed[rows, tokens] = x


@dataclass
class StepProcessing:
    """One step's logits processing. Index tensors name sampling rows (`rows`) and tokens."""

    allowed: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # rows, mask rows, mask
    bad_words: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # rows, tokens, last
    min_tokens: tuple[torch.Tensor, torch.Tensor] | None = None  # rows, stop tokens
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # rows, tokens, bias
    penalties: Penalties | None = None
    draft_penalties: DraftPenalties | None = None  # verification rows' drafts, counted
    last_tokens: tuple[torch.Tensor, torch.Tensor] | None = None  # input ids, logits indices

    @property
    def empty(self) -> bool:
        return not (
            self.allowed or self.bad_words or self.min_tokens or self.logit_bias or self.penalties
        )

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Processed float32 logits; the input (raw logits, which raw logprobs read) is never
        written."""
        processed = logits
        if self.allowed or self.bad_words or self.min_tokens or self.logit_bias:
            processed = logits.to(torch.float32, copy=True)
        if self.allowed is not None:
            rows, mask_rows, mask = self.allowed
            processed[rows] = processed[rows].masked_fill(mask[mask_rows], float("-inf"))
        if self.bad_words is not None:
            rows, tokens, last = self.bad_words
            input_ids, logits_indices = self.last_tokens
            follows = (last < 0) | (input_ids[logits_indices[rows]] == last)
            ban = torch.where(follows, float("-inf"), 0.0)  # summed: repeated bans agree
            processed.index_put_((rows, tokens), ban, accumulate=True)
        if self.min_tokens is not None:
            processed[self.min_tokens] = float("-inf")
        if self.logit_bias is not None:
            rows, tokens, bias = self.logit_bias
            processed.index_put_((rows, tokens), bias, accumulate=True)
        if self.penalties is not None:
            p, drafts = self.penalties, self.draft_penalties
            before = None if drafts is None else drafts.gather(processed)
            state = (p.batch_rows, p.repetition, p.frequency, p.presence)
            processed = apply_penalties(
                processed, *state, p.output_counts, p.prompt_mask, in_place=processed is not logits
            )
            if drafts is not None:
                drafts.correct(processed, before, p)
        return processed

    def record_sampled(self, sampled: torch.Tensor, kept: torch.Tensor | None = None) -> None:
        """Count this step's sampled tokens (those `kept`, if given: a verification's) into
        the penalized requests' output counts."""
        p = self.penalties
        if p is not None:
            ones = torch.ones_like(sampled, dtype=torch.int32) if kept is None else kept.int()
            p.output_counts.index_put_((p.batch_rows, sampled), ones, accumulate=True)


class LogitsProcessors:
    """The logits-processing settings of the requests in the persistent batch, by row."""

    def __init__(self, max_num_reqs: int, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.max_num_reqs = max_num_reqs
        self.min_tokens = np.zeros(max_num_reqs, dtype=np.int64)  # 0: none
        self.stop_ids: dict[int, np.ndarray] = {}  # rows with min_tokens: what it masks
        self.bad_words: dict[int, list[list[int]]] = {}
        self.logit_bias: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.allowed: set[int] = set()
        self.penalized = np.zeros(max_num_reqs, dtype=bool)
        self.penalty_params = np.zeros((3, max_num_reqs), dtype=np.float32)
        self.penalty_params[0] = 1.0  # repetition, frequency, presence
        # device state, allocated when a request first needs it
        self.allowed_mask: torch.Tensor | None = None  # True: not allowed
        self.output_counts: torch.Tensor | None = None
        self.prompt_mask: torch.Tensor | None = None

    def add(
        self,
        row: int,
        params: SamplingParams,
        token_ids: list[int],
        num_prompt: int,
        min_tokens_stop_ids: list[int],
    ) -> None:
        """A request takes `row`; token_ids are its prompt and any output so far,
        `min_tokens_stop_ids` what its min_tokens masks."""
        self.remove(row)
        if params.min_tokens and min_tokens_stop_ids:
            self.min_tokens[row] = params.min_tokens
            self.stop_ids[row] = np.array(min_tokens_stop_ids, dtype=np.int64)
        if params.bad_words_token_ids:
            self.bad_words[row] = params.bad_words_token_ids
        if params.logit_bias:
            tokens = np.fromiter(params.logit_bias.keys(), np.int64, len(params.logit_bias))
            bias = np.fromiter(params.logit_bias.values(), np.float32, len(params.logit_bias))
            self.logit_bias[row] = (tokens, bias)
        if params.allowed_token_ids is not None:
            self.allowed.add(row)
            if self.allowed_mask is None:
                self.allowed_mask = self._state(torch.bool)
            self.allowed_mask[row] = True
            allowed = to_device(np.array(params.allowed_token_ids, dtype=np.int64), self.device)
            self.allowed_mask[row, allowed] = False
        if params.needs_penalties:
            self.penalized[row] = True
            self.penalty_params[:, row] = (
                params.repetition_penalty,
                params.frequency_penalty,
                params.presence_penalty,
            )
            self._init_penalty_state(row, token_ids, num_prompt)

    def remove(self, row: int) -> None:
        self.min_tokens[row] = 0
        self.stop_ids.pop(row, None)
        self.bad_words.pop(row, None)
        self.logit_bias.pop(row, None)
        self.allowed.discard(row)
        if self.penalized[row]:
            self.penalized[row] = False
            self.penalty_params[:, row] = (1.0, 0.0, 0.0)

    @property
    def active(self) -> bool:
        return bool(
            self.stop_ids
            or self.bad_words
            or self.logit_bias
            or self.allowed
            or self.penalized.any()
        )

    def prepare(
        self,
        rows: np.ndarray,
        num_tokens: np.ndarray,
        batch: InputBatch,
        host: HostViews,
        dev: DeviceViews,
        drafts_before: list[list[int]] | None = None,
    ) -> StepProcessing | None:
        """The processing of the step whose sampling rows are the batch `rows` (their
        requests' lengths before this sample in `num_tokens`; with draft tokens, each row's
        drafts before it in `drafts_before`); None when no row uses any. Fills the penalty
        lanes of the step buffers before they are copied."""
        if not self.active:
            return None
        step = StepProcessing()
        n = len(rows)
        num_prompt = batch.num_prompt_tokens[rows]
        num_outputs = num_tokens - num_prompt
        token_ids = batch.token_ids
        if self.allowed:
            js = [j for j, row in enumerate(rows.tolist()) if row in self.allowed]
            if js:
                js = np.array(js, dtype=np.int64)
                mask_rows = self._up(rows[js])
                step.allowed = (self._up(js), mask_rows, self.allowed_mask)
        if self.bad_words:
            step.bad_words = self._bad_words(rows, num_outputs, token_ids, num_prompt)
            step.last_tokens = (dev.input_ids, dev.logits_indices[:n])
        if self.stop_ids:
            js = np.flatnonzero(num_outputs < self.min_tokens[rows])
            if len(js):
                stops = [self.stop_ids[row] for row in rows[js].tolist()]
                lens = [len(s) for s in stops]
                step.min_tokens = (self._up(np.repeat(js, lens)), self._up(np.concatenate(stops)))
        if self.logit_bias:
            found = [(j, self.logit_bias.get(row)) for j, row in enumerate(rows.tolist())]
            found = [(j, b) for j, b in found if b is not None]
            if found:
                js = np.repeat([j for j, _ in found], [len(b[0]) for _, b in found])
                tokens = np.concatenate([b[0] for _, b in found])
                bias = np.concatenate([b[1] for _, b in found])
                step.logit_bias = (self._up(js), self._up(tokens), self._up(bias))
        if self.penalized[rows].any():
            host.batch_rows[:n] = rows
            host.repetition_penalty[:n] = self.penalty_params[0, rows]
            host.frequency_penalty[:n] = self.penalty_params[1, rows]
            host.presence_penalty[:n] = self.penalty_params[2, rows]
            step.penalties = Penalties(
                dev.batch_rows[:n],
                dev.repetition_penalty[:n],
                dev.frequency_penalty[:n],
                dev.presence_penalty[:n],
                self.output_counts,
                self.prompt_mask,
            )
            if drafts_before is not None:
                step.draft_penalties = self._draft_penalties(rows, drafts_before)
        return None if step.empty else step

    def _draft_penalties(
        self, rows: np.ndarray, drafts_before: list[list[int]]
    ) -> DraftPenalties | None:
        pairs: list[tuple[int, int, int]] = []
        for j, (row, drafts) in enumerate(zip(rows.tolist(), drafts_before, strict=True)):
            if drafts and self.penalized[row]:
                counts: dict[int, int] = {}
                for token in drafts:
                    counts[token] = counts.get(token, 0) + 1
                pairs.extend((j, token, c) for token, c in counts.items())
        if not pairs:
            return None
        rows_, tokens, extra = np.array(pairs, dtype=np.int64).T
        return DraftPenalties(self._up(rows_), self._up(tokens), self._up(extra.astype(np.int32)))

    def _bad_words(
        self,
        rows: np.ndarray,
        num_outputs: np.ndarray,
        token_ids: np.ndarray,
        num_prompt: np.ndarray,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(row, banned token, the last token it must follow or -1) for each bad word whose
        prefix, but for its last token, ends the output."""
        bans: list[tuple[int, int, int]] = []
        for j, row in enumerate(rows.tolist()):
            words = self.bad_words.get(row)
            if words is None:
                continue
            end = int(num_prompt[j] + num_outputs[j])  # the output is token_ids[row, P:end]
            for word in words:
                prefix = len(word) - 1
                if prefix > num_outputs[j]:
                    continue
                if prefix == 0:
                    bans.append((j, word[-1], -1))
                elif token_ids[row, end - prefix : end - 1].tolist() == word[: prefix - 1]:
                    bans.append((j, word[-1], word[-2]))
        if not bans:
            return None
        return tuple(self._up(np.array(bans, dtype=np.int64).T))

    def _init_penalty_state(self, row: int, token_ids: list[int], num_prompt: int) -> None:
        if self.output_counts is None:
            self.output_counts = self._state(torch.int32)
            self.prompt_mask = self._state(torch.bool)
        ids = self._up(np.array(token_ids, dtype=np.int64))
        self.prompt_mask[row] = False
        self.prompt_mask[row, ids[:num_prompt]] = True
        self.output_counts[row] = 0
        out = ids[num_prompt:]
        self.output_counts[row].index_add_(0, out, torch.ones_like(out, dtype=torch.int32))

    def _state(self, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(self.max_num_reqs, self.vocab_size, dtype=dtype, device=self.device)

    def _up(self, array: np.ndarray) -> torch.Tensor:
        return to_device(np.ascontiguousarray(array), self.device)
