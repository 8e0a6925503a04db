"""Prompt logprobs: during prefill, the logprobs of each prompt token given the ones before.

The hidden state at prompt position p predicts token p + 1, so a chunk that computes
positions [start, start + q) yields the logprobs of prompt tokens start + 1 .. (up to the last
prompt token); the engine-core joins a request's chunks. The logits of a long chunk are made
`max_rows` at a time, so a prefill of thousands of tokens never holds [tokens, vocab] floats.
A rarely used feature: written for clarity, it runs only for requests that asked.
"""

from __future__ import annotations

import torch

from minivllm.config import EngineConfig
from minivllm.worker.input_batch import InputBatch, RequestState
from minivllm.worker.logits_processors import to_device
from minivllm.worker.ops.logprobs import gather_logprobs
from minivllm.worker.sampler import LogprobsTensors


def compute_prompt_logprobs(
    model: torch.nn.Module,
    hidden: torch.Tensor,
    states: list[RequestState],
    query_start: torch.Tensor,
    batch: InputBatch,
    config: EngineConfig,
) -> dict[str, LogprobsTensors]:
    """req_id -> the logprobs this step's chunk gives, for the requests that asked.

    `states` are the step's requests with their `num_computed_tokens` before the step,
    `query_start` (host) their first rows in `hidden`."""
    query_start = query_start.numpy()
    token_ids = batch.token_ids
    max_rows = config.scheduler.max_num_seqs
    normalize = config.model.logprobs_mode.endswith("logprobs")  # else the *_logits modes
    out: dict[str, LogprobsTensors] = {}
    for i, state in enumerate(states):
        num = state.params.prompt_logprobs
        if num is None:
            continue
        start = state.num_computed_tokens
        end = min(int(query_start[i + 1] - query_start[i]) + start, state.num_prompt_tokens - 1)
        if end <= start:
            continue
        targets = to_device(token_ids[state.row, start + 1 : end + 1].copy(), hidden.device)
        rows = hidden[int(query_start[i]) : int(query_start[i]) + end - start]
        parts = []
        for a in range(0, end - start, max_rows):
            logits = model.compute_logits(rows[a : a + max_rows])
            k = logits.shape[-1] if num == -1 else num
            parts.append(gather_logprobs(logits, k, targets[a : a + max_rows], normalize))
        out[state.req_id] = tuple(torch.cat(column) for column in zip(*parts, strict=True))
    return out
