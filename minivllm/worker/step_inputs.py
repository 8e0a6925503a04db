"""A step's inputs: which requests run in what order, and what the step buffers hold for them.

`ModelRunner._prepare_inputs` builds a `StepInputs` in named phases:

    order_requests      the scheduled requests, single-token ones (decodes) first, with their
                        lengths (`ScheduledBatch`, on the host);
    plan_forward        a CUDA graph and its padding, or an eager forward; cascade
                        attention; FP8 KV scales (`ForwardPlan`);
    write_token_inputs  input ids, positions, slot mapping, query starts, sequence lengths,
                        decode order and block table rows, padding included;
    prepare_sampling    which requests sample and from which token rows (a request that
                        verifies d draft tokens samples its last d + 1 rows), the draft
                        each such row checks, and the rows' sampling parameters;
    write_in_flight     the input ids only the device has yet (the newest step's samples):
                        where to gather them from;

then copies the buffers to the device in one go and gathers the in-flight ids there.
`ExecutedStep` is a step between the runner's two calls, `execute_model` and `sample_tokens`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from minivllm.protocol.messages import SchedulerOutput
from minivllm.worker.attention.cascade import use_cascade
from minivllm.worker.attention.metadata import AttentionMetadata
from minivllm.worker.cuda_graphs import RunnerGraphs, StepGraphs
from minivllm.worker.input_batch import InputBatch, RequestState
from minivllm.worker.logits_processors import LogitsProcessors
from minivllm.worker.sampler import SamplingMetadata
from minivllm.worker.spec_decode.verification import Verification
from minivllm.worker.step_buffers import HostViews, StepBuffers


@dataclass
class ScheduledBatch:
    """A step's requests in batch order (decodes first) and their lengths; int64 [n] each."""

    requests: list[RequestState]
    num_decodes: int  # requests 0..num_decodes-1 run one token
    rows: np.ndarray  # their rows of the persistent batch
    query_lens: np.ndarray  # tokens scheduled this step
    computed: np.ndarray  # tokens with KV before this step
    seq_lens: np.ndarray  # computed + query_lens
    num_tokens: np.ndarray  # known tokens, samples still in flight included
    num_host_tokens: np.ndarray  # of those, the ones whose ids the host has
    num_drafts: np.ndarray  # draft tokens verified (the last of query_lens)
    drafts: dict[str, list[int]]  # req_id -> them (SchedulerOutput.scheduled_spec_decode_tokens)
    total: int  # tokens scheduled this step

    @property
    def num_seqs(self) -> int:
        return len(self.requests)


@dataclass
class ForwardPlan:
    """How the forward runs: a graph replay over padded buffers, or eagerly (graphs None)."""

    graphs: StepGraphs | None
    num_tokens: int  # token rows the forward computes, padding included
    num_seqs: int  # sequence rows, padding included
    cascade_prefix_len: int  # tokens every decode row shares, read once (0: no cascade)
    compute_kv_scales: bool  # this step sets the FP8 KV scales (eagerly)


@dataclass
class SamplingInputs:
    """Where a step's samples come from: one logits row per sampling request, or, for one
    that verifies d draft tokens, d + 1 (its last token's and each draft's)."""

    req_idx: list[int]  # the requests that sample (indices into StepInputs.requests), in row order
    logits_indices: torch.Tensor  # int64 [rows] on the device: the token rows sampled
    metadata: SamplingMetadata
    num_rows: np.ndarray  # int64 [len(req_idx)]: rows of each
    verification: Verification | None = None  # the drafts checked, if any


@dataclass
class StepInputs:
    requests: list[RequestState]  # in batch order: decodes first
    attn: AttentionMetadata
    plan: ForwardPlan
    sampling: SamplingInputs | None  # None: no request samples (prompt chunks only)


@dataclass
class ExecutedStep:
    """A step between `execute_model` and `sample_tokens`."""

    step_id: int
    req_ids: list[str]  # the scheduled requests, in batch order
    structured_req_ids: list[str]  # those its grammar bitmask constrains, in bitmask order
    inputs: StepInputs | None = None  # None: nothing was scheduled
    hidden: torch.Tensor | None = None  # [rows, H]: the final hidden states of the logits rows
    logits: torch.Tensor | None = None  # [rows, V]; None: the LM head draws (ParallelLMHead.draw)
    prompt_logprobs: dict | None = None  # by request id, if some request asked

    @property
    def sampling(self) -> SamplingInputs | None:
        return None if self.inputs is None else self.inputs.sampling

    @property
    def sampling_requests(self) -> list[RequestState]:
        """The requests that sample, in logits-row order."""
        sampling = self.sampling
        if sampling is None:
            return []
        requests = self.inputs.requests
        return [requests[i] for i in sampling.req_idx]


def order_requests(so: SchedulerOutput, batch: InputBatch) -> ScheduledBatch:
    """The scheduled requests, decodes first, and their lengths."""
    reqs, drafts = batch.requests, so.scheduled_spec_decode_tokens
    decodes, others, other_lens = [], [], []
    for req_id, q in so.num_scheduled_tokens.items():
        if q == 1:
            decodes.append(reqs[req_id])
        else:
            others.append(reqs[req_id])
            other_lens.append(q)
    requests = decodes + others
    n, nd = len(requests), len(decodes)
    query_lens = np.ones(n, dtype=np.int64)
    query_lens[nd:] = other_lens
    computed = np.fromiter((s.num_computed_tokens for s in requests), np.int64, n)
    num_drafts = np.zeros(n, dtype=np.int64)
    if drafts:
        num_drafts[nd:] = [len(drafts.get(s.req_id, ())) for s in others]
    return ScheduledBatch(
        requests=requests,
        num_decodes=nd,
        rows=np.fromiter((s.row for s in requests), np.int64, n),
        query_lens=query_lens,
        computed=computed,
        seq_lens=computed + query_lens,
        num_tokens=np.fromiter((s.num_tokens for s in requests), np.int64, n),
        num_host_tokens=np.fromiter((s.num_host_tokens for s in requests), np.int64, n),
        num_drafts=num_drafts,
        drafts=drafts,
        total=int(so.total_num_scheduled_tokens),
    )


def plan_forward(
    so: SchedulerOutput,
    sched: ScheduledBatch,
    graphs: RunnerGraphs | None,
    cascade: bool,
    block_size: int,
    compute_kv_scales: bool,
) -> ForwardPlan:
    """A CUDA graph replay (of `graphs`; None: no graphs) and its padded sizes, or an eager
    forward; `cascade`: whether cascade attention may run; `compute_kv_scales`: this step
    sets the FP8 KV scales (eagerly: a graph has none)."""
    n, nd = sched.num_seqs, sched.num_decodes
    prefix_len = 0
    if cascade and so.num_common_prefix_blocks and nd and not (nd < n and graphs is not None):
        # With graphs only pure-decode steps (replays) use it: a step with prompt tokens is
        # rare, and would compile kernel variants for its decode count mid-run.
        prefix_len = _cascade_prefix_len(so, sched.computed[:nd], block_size)
    picked, num_tokens, num_seqs = None, sched.total, n
    if graphs is not None and not compute_kv_scales:
        max_query_len = int(sched.query_lens.max())
        picked, num_tokens, num_seqs = graphs.pick(
            n, nd, sched.total, bool(prefix_len), max_query_len
        )
    return ForwardPlan(picked, num_tokens, num_seqs, prefix_len, compute_kv_scales)


def _cascade_prefix_len(so: SchedulerOutput, computed: np.ndarray, block_size: int) -> int:
    """Tokens at the head of every decode row's context (their `computed` lengths) that
    cascade attention should read once this step (0: attend as usual). The blocks held by
    every running request are whole, cached and computed; the prefix stops at the shortest
    decode context."""
    bs = block_size
    prefix_len = min(so.num_common_prefix_blocks * bs, int(computed.min()) // bs * bs)
    return prefix_len if use_cascade(len(computed), prefix_len) else 0


def write_token_inputs(
    h: HostViews,
    sched: ScheduledBatch,
    plan: ForwardPlan,
    batch: InputBatch,
    block_size: int,
    decode_order: bool,
) -> None:
    """Fill the token- and sequence-level views, and the padding a graph replay reads:
    padding tokens store no KV, padding rows have no context. `decode_order`: the attention
    kernels start the longest contexts first (padding rows last)."""
    n, nd, total, bs = sched.num_seqs, sched.num_decodes, sched.total, block_size
    rows, seq_lens = sched.rows, sched.seq_lens
    cu = h.query_start_loc[: n + 1]
    cu[0] = 0
    np.cumsum(sched.query_lens, out=cu[1:])
    if nd == n:
        tok_rows, positions = rows, sched.computed
    else:
        tok_rows = np.repeat(rows, sched.query_lens)
        starts = np.repeat(sched.computed - cu[:-1], sched.query_lens)
        positions = starts + np.arange(total)
    h.positions[:total] = positions
    if batch.long_rope_threshold is not None:  # the model reads positions as rotary rows
        h.positions[:total] += batch.rope_row_offset[tok_rows]
    h.input_ids[:total] = batch.token_ids[tok_rows, positions]
    h.slot_mapping[:total] = batch.block_table[tok_rows, positions // bs] * bs + positions % bs
    h.seq_lens[:n] = seq_lens
    h.cascade_prefix_len[0] = plan.cascade_prefix_len
    if plan.graphs is not None:
        h.input_ids[total : plan.num_tokens] = 0
        h.positions[total : plan.num_tokens] = 0
        h.slot_mapping[total : plan.num_tokens] = -1
        h.seq_lens[n : plan.num_seqs] = 0
        h.query_start_loc[n + 1 : plan.num_seqs + 1] = total
    if decode_order and nd:
        h.decode_order[:nd] = np.argsort(-seq_lens[:nd], kind="stable")
        h.decode_order[nd : plan.num_seqs] = np.arange(nd, plan.num_seqs)
    width = -(-int(seq_lens.max()) // bs)
    h.block_table[:n, :width] = batch.block_table[rows, :width]


def prepare_sampling(
    sched: ScheduledBatch, batch: InputBatch, processors: LogitsProcessors, buffers: StepBuffers
) -> SamplingInputs | None:
    """The logits rows and sampling parameters of the requests that sample (with draft
    tokens, a row per position verified), written into the step buffers."""
    h, d = buffers.host, buffers.dev
    req_idx, counts = write_logits_rows(h, sched)
    if not len(req_idx):
        return None
    rows, positions = sched.rows[req_idx], sched.seq_lens[req_idx] - (counts - 1)
    verification, drafts_before = None, None
    num_rows = len(req_idx)
    if sched.drafts:
        num_rows = int(counts.sum())
        width = write_verification(h, sched, req_idx, counts)
        verification = Verification(
            counts, width, d.draft_ids[:num_rows], d.sample_slots[:num_rows]
        )
        offsets = h.sample_slots[:num_rows] % width
        rows = np.repeat(rows, counts)
        positions = np.repeat(positions, counts) + offsets
        if processors.active:  # each row's drafts before it count as its output
            drafts = h.draft_ids[:num_rows].tolist()
            starts = (np.arange(num_rows) - offsets).tolist()
            drafts_before = [
                drafts[s : s + j] for s, j in zip(starts, offsets.tolist(), strict=True)
            ]
    metadata = SamplingMetadata.prepare(batch, processors, buffers, rows, positions, drafts_before)
    logits_indices = d.logits_indices[:num_rows]
    return SamplingInputs(req_idx.tolist(), logits_indices, metadata, counts, verification)


def write_logits_rows(h: HostViews, sched: ScheduledBatch) -> tuple[np.ndarray, np.ndarray]:
    """The requests that sample (those whose every known token has KV after this step), as
    indices into `sched.requests`, and how many rows each samples (1 + its drafts); their
    last scheduled token rows go to `logits_indices`, each request's in order."""
    req_idx = np.flatnonzero(sched.seq_lens >= sched.num_tokens)
    ends = h.query_start_loc[1 : sched.num_seqs + 1][req_idx]
    counts = 1 + sched.num_drafts[req_idx]
    if not sched.drafts:
        h.logits_indices[: len(req_idx)] = ends - 1
        return req_idx, counts
    offsets = _offsets(counts)
    h.logits_indices[: len(offsets)] = np.repeat(ends - counts, counts) + offsets
    return req_idx, counts


def write_verification(
    h: HostViews, sched: ScheduledBatch, req_idx: np.ndarray, counts: np.ndarray
) -> int:
    """For each sampling row: the draft it checks (-1 for a request's last row) and its
    slot in the [len(req_idx), width] table of the step's tokens. Returns the width."""
    width, num_rows = int(counts.max()), int(counts.sum())
    draft_ids = np.full(num_rows, -1, dtype=np.int64)
    start = 0
    for i, c in zip(req_idx.tolist(), counts.tolist(), strict=True):
        if c > 1:
            draft_ids[start : start + c - 1] = sched.drafts[sched.requests[i].req_id]
        start += c
    h.draft_ids[:num_rows] = draft_ids
    h.sample_slots[:num_rows] = np.repeat(np.arange(len(counts)) * width, counts) + _offsets(counts)
    return width


def _offsets(counts: np.ndarray) -> np.ndarray:
    """0..c-1 for each count c, one after another."""
    return np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)


def write_in_flight(h: HostViews, sched: ScheduledBatch, latest: object) -> int:
    """The last known token of a decoding request may be the newest step's sample (`latest`,
    its output), which only the device has yet: where to gather each such token from
    (`gather_src`, rows of that step's sampled ids) and to (`gather_dst`, the input row of
    that token: the request's first, before any drafts). Returns how many there are."""
    reads_last = sched.seq_lens >= sched.num_tokens
    in_flight = np.flatnonzero(reads_last & (sched.num_tokens > sched.num_host_tokens))
    for g, i in enumerate(in_flight.tolist()):
        out, j = sched.requests[i].last_sample
        assert out is latest, "an in-flight token of an older step was not applied"
        h.gather_src[g] = j
    last = sched.num_tokens[in_flight] - 1 - sched.computed[in_flight]
    h.gather_dst[: len(in_flight)] = h.query_start_loc[:-1][in_flight] + last
    return len(in_flight)
