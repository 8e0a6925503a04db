"""The sampler: the one way from a step's logits to its sampled tokens.

`Sampler.__call__` takes the full-vocabulary logits of the rows that sample, their
`SamplingMetadata` and the step's grammar mask, if it has one, and works in vLLM's order:

1. the raw logits are kept for raw logprobs (the default `logprobs_mode`);
2. logits processing: a structured-output grammar's token bitmask on the rows it
   constrains (`ops.bitmask`, in place, as vLLM masks before its sampler: raw logprobs see
   it), then (`StepProcessing.apply`) allowed token ids, bad words, min_tokens, logit bias,
   penalties, on a float32 copy, each only if some row uses it;
3. the draw (`ops.sampling.sample`: temperature, min-p, top-k, top-p, greedy or seeded
   random; a Triton kernel on CUDA, its torch reference elsewhere; a step whose every row
   is greedy takes one argmax instead, the token the draw picks for a greedy row);
4. with draft tokens to verify, which of them the step accepts (spec_decode/verification.py:
   the rows are the positions after the request's last token and each of its drafts);
5. the logprobs asked for (`ops.logprobs.gather_logprobs`): the sampled token's, its rank
   and the top-k, from the raw logits, or from what the draw saw (processed modes).

With tensor parallelism every rank gets the gathered logits and samples the whole row. A
step that needs no more of a row than its best token (no filter, processing, grammar or
logprobs: `SamplingMetadata.needs_whole_rows`) skips the gather and the sampler: the LM head
draws on each rank's slice of the vocabulary (`ParallelLMHead.draw`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from minivllm.protocol.sampling_params import GREEDY_EPS
from minivllm.worker.grammar_bitmask import GrammarMask
from minivllm.worker.input_batch import NO_LOGPROBS, InputBatch
from minivllm.worker.logits_processors import LogitsProcessors, StepProcessing, to_device
from minivllm.worker.ops.bitmask import apply_token_bitmask
from minivllm.worker.ops.logprobs import gather_logprobs
from minivllm.worker.ops.sampling import argmax_rows, filtered_scores, sample
from minivllm.worker.spec_decode.verification import Verification, VerifiedTokens, verify
from minivllm.worker.step_buffers import StepBuffers

LogprobsTensors = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # ids, logprobs, ranks


@dataclass
class LogprobsRequest:
    """Which sampling rows want logprobs of their sampled token, and how many top ones."""

    rows: torch.Tensor | None  # int64 indices into the sampling rows; None: every row
    rows_host: list[int] | None  # the same on the host
    num: int  # the most any of them asked (the vocabulary size for -1)


@dataclass
class SamplerOutput:
    sampled: torch.Tensor  # int64 [N]: each sampling request's (last) token
    logprobs: LogprobsTensors | None = None  # see gather_logprobs
    logprobs_rows: list[int] | None = None  # the sampling rows of the logprobs; None: all
    verified: VerifiedTokens | None = None  # a step that verified drafts: all its tokens

    @classmethod
    def of(cls, sampled: torch.Tensor, verification: Verification | None) -> SamplerOutput:
        """The output of rows drawn without anything else to do (`ParallelLMHead.draw`)."""
        if verification is None:
            return cls(sampled)
        verified = verify(sampled, verification)
        return cls(verified.last, verified=verified)


@dataclass
class SamplingMetadata:
    """One step's sampling rows: per-row parameters [N] on the device, and which filters any
    row uses (decided on the host, so a filter nobody asked for costs nothing)."""

    temperature: torch.Tensor  # float32; below GREEDY_EPS: greedy
    top_k: torch.Tensor  # int32; 0: off
    top_p: torch.Tensor  # float32; 1: off
    min_p: torch.Tensor  # float32; 0: off
    seeds: torch.Tensor  # int64; the request's seed
    positions: torch.Tensor  # int64; the position of the token being sampled
    use_top_k: bool
    use_top_p: bool
    use_min_p: bool
    all_greedy: bool  # every row greedy: the draw is one argmax
    processing: StepProcessing | None = None  # None: no row uses any logits processing
    logprobs: LogprobsRequest | None = None  # None: no row asked

    @classmethod
    def from_buffers(
        cls,
        buffers: StepBuffers,
        n: int,
        processing: StepProcessing | None = None,
        logprobs: LogprobsRequest | None = None,
    ) -> SamplingMetadata:
        """The first n sampling rows the runner wrote into the step buffers."""
        d, h = buffers.dev, buffers.host
        return cls(
            temperature=d.temperature[:n],
            top_k=d.top_k[:n],
            top_p=d.top_p[:n],
            min_p=d.min_p[:n],
            seeds=d.seeds[:n],
            positions=d.sample_positions[:n],
            use_top_k=bool((h.top_k[:n] > 0).any()),
            use_top_p=bool((h.top_p[:n] < 1.0).any()),
            use_min_p=bool((h.min_p[:n] > 0.0).any()),
            all_greedy=bool((h.temperature[:n] < GREEDY_EPS).all()),
            processing=processing,
            logprobs=logprobs,
        )

    @classmethod
    def prepare(
        cls,
        batch: InputBatch,
        processors: LogitsProcessors,
        buffers: StepBuffers,
        rows: np.ndarray,
        num_tokens: np.ndarray,
        drafts_before: list[list[int]] | None = None,
    ) -> SamplingMetadata:
        """Write the sampling rows' parameters into the step buffers (before they are copied)
        and describe the step: `rows` are the sampling rows' persistent-batch rows,
        `num_tokens` their requests' lengths before this sample (with draft tokens verified,
        each row's drafts before it are `drafts_before`)."""
        n = len(rows)
        h = buffers.host
        h.temperature[:n] = batch.temperature[rows]
        h.top_k[:n] = batch.top_k[rows]
        h.top_p[:n] = batch.top_p[rows]
        h.min_p[:n] = batch.min_p[rows]
        h.seeds[:n] = batch.seeds[rows]
        h.sample_positions[:n] = num_tokens
        processing = processors.prepare(rows, num_tokens, batch, h, buffers.dev, drafts_before)
        logprobs = None
        num_logprobs = batch.num_logprobs[rows] if batch.num_with_logprobs else None
        asking = () if num_logprobs is None else np.flatnonzero(num_logprobs != NO_LOGPROBS)
        if len(asking):
            wanted = num_logprobs[asking]
            num = processors.vocab_size if (wanted == -1).any() else int(wanted.max())
            if len(asking) == n:
                logprobs = LogprobsRequest(None, None, num)
            else:
                logprobs = LogprobsRequest(to_device(asking, buffers.device), asking.tolist(), num)
        return cls.from_buffers(buffers, n, processing, logprobs)

    @property
    def needs_whole_rows(self) -> bool:
        """Whether some row needs more than its own logits one by one."""
        return (
            self.use_top_k
            or self.use_top_p
            or self.use_min_p
            or self.processing is not None
            or self.logprobs is not None
        )

    def filters(self) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """top_k, top_p, min_p, each None when no row uses it."""
        return (
            self.top_k if self.use_top_k else None,
            self.top_p if self.use_top_p else None,
            self.min_p if self.use_min_p else None,
        )


class Sampler:
    def __init__(self, logprobs_mode: str = "raw_logprobs") -> None:
        self.logprobs_mode = logprobs_mode

    def __call__(
        self,
        logits: torch.Tensor,
        meta: SamplingMetadata,
        grammar: GrammarMask | None = None,
        verification: Verification | None = None,
    ) -> SamplerOutput:
        """The sampled ids (and logprobs) on the device for the logits [N, V] of the sampling
        rows; `grammar`'s bitmask is applied to its rows in place first. With a
        `verification`, the rows are those of requests verifying drafts too, and the output
        holds each request's accepted drafts and next token."""
        if grammar is not None:
            apply_token_bitmask(logits, grammar.bitmask, grammar.rows)
        processed = logits if meta.processing is None else meta.processing.apply(logits)
        if meta.all_greedy:  # the draw's pick on greedy rows, without its launches
            sampled = argmax_rows(processed)
        else:
            top_k, top_p, min_p = meta.filters()
            sampled = sample(
                processed, meta.temperature, top_k, top_p, min_p, meta.seeds, meta.positions
            )
        verified = kept = None
        row_tokens = sampled
        if verification is not None:
            verified = verify(sampled, verification, processed, meta)
            row_tokens, kept = verified.row_tokens, verified.kept
        if meta.processing is not None:
            meta.processing.record_sampled(row_tokens, kept)
        last = sampled if verified is None else verified.last
        if meta.logprobs is None:
            return SamplerOutput(last, verified=verified)
        logprobs = self._logprobs(logits, processed, row_tokens, meta)
        return SamplerOutput(last, logprobs, meta.logprobs.rows_host, verified)

    def _logprobs(
        self,
        logits: torch.Tensor,
        processed: torch.Tensor,
        sampled: torch.Tensor,
        meta: SamplingMetadata,
    ) -> LogprobsTensors:
        mode = self.logprobs_mode
        raw = mode.startswith("raw")  # else what the draw saw
        scores = logits if raw else filtered_scores(processed, meta.temperature, *meta.filters())
        rows = meta.logprobs.rows
        if rows is not None:
            scores, sampled = scores.index_select(0, rows), sampled.index_select(0, rows)
        return gather_logprobs(scores, meta.logprobs.num, sampled, mode.endswith("logprobs"))
