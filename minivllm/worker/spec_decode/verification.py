"""Verifying draft tokens: which of them a step accepts, and the tokens it returns.

A step that verifies d drafts x_1..x_d of a request samples 1 + d rows for it: row j gives
the target's distribution p_j of the token after the request's last token and x_1..x_j. The
rule is vLLM's rejection sampler, which keeps every token distributed exactly as the target
would sample it: x_{j+1} is accepted with probability min(1, p_j(x)/q_j(x)), q_j being the
distribution the draft was drawn from; at the first rejection the row's token is drawn from
norm(max(p_j - q_j, 0)) and the request's tokens end there; if all d are accepted, one more
token (the bonus) is drawn from p_d. Greedy rows accept a draft iff it is the argmax.

A proposal with no distribution (n-gram, or a draft model's greedy proposal) has q one-hot
at x: x is accepted with probability p(x), and the residual is p without x. Drawing the
row's token y from p as a step without speculation does (`ops.sampling.sample`, keyed by
the request's seed and the token's position) and accepting x iff y == x is exactly that
rule: P(y = x) = p(x), and y given y != x follows p without x. So these rows take the
ordinary draw, and a seeded (or greedy) request returns the tokens it would without
speculation. Rows with a draft distribution (a draft model sampling at temperature > 0)
draw their acceptance and residual from noise of their own.

Everything stays on the device (`ops.accepted_tokens`: one kernel on CUDA): the accepted
counts reach the host with the step's tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from minivllm.worker.ops.accepted_tokens import accepted_tokens
from minivllm.worker.ops.sampling import filtered_scores, sample, uniform_noise

# salts the request's seed for the acceptance draws, apart from the token draws' noise
ACCEPT_SALT = 0x5DEECE66D


@dataclass
class DraftProbs:
    """The distributions drafts were drawn from, for the verification rows that have one."""

    rows: torch.Tensor  # int64 [Q]: sampling rows (of the step) whose draft has q
    probs: torch.Tensor  # float32 [Q, V]: q of each


@dataclass
class Verification:
    """The drafts a step verifies, laid out over its sampling rows (R of them)."""

    num_rows: np.ndarray  # int64 [n]: rows of each sampling request (1 + its drafts)
    width: int  # the most rows of one request
    draft_ids: torch.Tensor  # int64 [R]: the draft each row checks; -1: none (a last row)
    slots: torch.Tensor  # int64 [R]: row j of request i is slot i * width + j
    draft_probs: DraftProbs | None = None


@dataclass
class VerifiedTokens:
    tokens: torch.Tensor  # int64 [n, width]: each request's tokens, -1 past its count
    num_tokens: torch.Tensor  # int64 [n]: accepted drafts + 1
    last: torch.Tensor  # int64 [n]: each request's last token
    row_tokens: torch.Tensor  # int64 [R]: the token each row returns, if it is kept
    kept: torch.Tensor  # bool [R]: the row's token is one of the request's tokens


def verify(
    sampled: torch.Tensor,
    v: Verification,
    processed: torch.Tensor | None = None,
    meta: object = None,
) -> VerifiedTokens:
    """The tokens of a verification step from its rows' ordinary draws `sampled` [R]; rows
    with a draft distribution also need the processed logits [R, V] and the sampling
    metadata (their temperatures, filters, seeds and positions)."""
    accept = sampled == v.draft_ids
    row_tokens = sampled
    if v.draft_probs is not None:
        accept, row_tokens = _accept_with_probs(sampled, accept, v, processed, meta)
    table, num_tokens, last, kept = accepted_tokens(
        row_tokens, accept, v.slots, len(v.num_rows), v.width
    )
    return VerifiedTokens(table, num_tokens, last, row_tokens, kept)


def _accept_with_probs(
    sampled: torch.Tensor,
    accept: torch.Tensor,
    v: Verification,
    processed: torch.Tensor,
    meta: object,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Acceptance and row tokens where the draft has a distribution q: accept x with
    probability min(1, p(x) / q(x)), else draw from norm(max(p - q, 0))."""
    dp = v.draft_probs
    rows = dp.rows
    x = v.draft_ids[rows]
    temperature = meta.temperature[rows]
    top_k, top_p, min_p = (None if f is None else f[rows] for f in meta.filters())
    p = filtered_scores(processed[rows], temperature, top_k, top_p, min_p).softmax(-1)
    q = dp.probs
    p_x = p.gather(1, x[:, None]).squeeze(1)
    q_x = q.gather(1, x[:, None]).squeeze(1)
    seeds, positions = meta.seeds[rows], meta.positions[rows]
    u = uniform_noise(seeds ^ ACCEPT_SALT, positions)
    accepted = u * q_x < p_x  # u < p / q, with q(x) > 0 for a drawn x
    residual = (p - q).clamp_min(0.0)
    # draw from the residual with the row's own noise (x and u have theirs); where p == q
    # everywhere nothing is ever rejected and the residual is never read
    ones = torch.ones_like(temperature)
    recovered = sample(residual.log(), ones, None, None, None, seeds, positions)
    accept = accept.clone()
    accept[rows] = accepted
    row_tokens = sampled.clone()
    row_tokens[rows] = torch.where(accepted, x, recovered)
    return accept, row_tokens
