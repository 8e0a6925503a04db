"""Verifying draft tokens keeps every token distributed as the target samples it: with drafts
that have no distribution (n-gram: accepted with probability p(x), else a draw from p without
x), and with drafts drawn from a draft distribution q (accepted with probability
min(1, p/q), else a draw from max(p - q, 0)); many seeded rows of a small vocabulary, against
the exact probabilities. And verification rows are penalized as if their drafts were output."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from minivllm.worker.ops.penalties import apply_penalties_reference
from minivllm.worker.ops.sampling import sample
from minivllm.worker.spec_decode.verification import DraftProbs, Verification, verify

V = 8
N = 40_000  # requests, each one draft and its bonus row


def chi2_threshold(df: int, z: float = 3.72) -> float:
    """The chi-square quantile of df degrees of freedom at z standard deviations (3.72: a
    chance of 1e-4 to fail by bad luck), by Wilson and Hilferty's approximation."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def assert_follows(samples: np.ndarray, probs: np.ndarray) -> None:
    """A chi-square test of the samples (indices) against `probs`; cells expected fewer
    than 5 times are pooled into one."""
    counts = np.bincount(samples, minlength=len(probs))
    expected = probs * len(samples)
    assert counts[expected == 0].sum() == 0, "a token of probability 0 was drawn"
    small = (expected > 0) & (expected < 5)
    counts = np.append(counts[expected >= 5], counts[small].sum())
    expected = np.append(expected[expected >= 5], expected[small].sum())
    cells = expected > 0
    chi2 = float(((counts[cells] - expected[cells]) ** 2 / expected[cells]).sum())
    assert chi2 < chi2_threshold(int(cells.sum()) - 1), (chi2, counts, expected.round())


class Rows:
    """The sampling rows of N requests with one draft each: row 2i checks the draft, row
    2i + 1 is the bonus (its token only counts when the draft is accepted)."""

    def __init__(self, logits_draft_row: torch.Tensor, logits_bonus_row: torch.Tensor) -> None:
        self.logits = torch.stack([logits_draft_row, logits_bonus_row]).repeat(N, 1)
        self.temperature = torch.ones(2 * N)
        self.seeds = torch.arange(2 * N, dtype=torch.int64) // 2 + 1000  # one per request
        self.positions = torch.arange(2 * N, dtype=torch.int64) % 2 + 7

    def filters(self) -> tuple[None, None, None]:
        return None, None, None

    def sampled(self) -> torch.Tensor:
        t = self.temperature
        return sample(self.logits, t, None, None, None, self.seeds, self.positions)

    def verification(self, drafts: torch.Tensor) -> Verification:
        draft_ids = torch.stack([drafts, torch.full_like(drafts, -1)], dim=1).reshape(-1)
        return Verification(np.full(N, 2), 2, draft_ids, torch.arange(2 * N))


def target() -> tuple[torch.Tensor, torch.Tensor, np.ndarray, np.ndarray]:
    gen = torch.Generator().manual_seed(0)
    first, second = torch.randn(V, generator=gen) * 1.5, torch.randn(V, generator=gen)
    return first, second, first.softmax(-1).numpy(), second.softmax(-1).numpy()


def test_drafts_without_a_distribution_keep_the_targets() -> None:
    first, second, p1, p2 = target()
    rows = Rows(first, second)
    x = 2  # every request proposes token 2 (n-gram: q is one-hot)
    out = verify(rows.sampled(), rows.verification(torch.full((N,), x)))
    tokens, num = out.tokens.numpy(), out.num_tokens.numpy()
    assert_follows(tokens[:, 0], p1)  # the first token follows p, whatever was proposed
    accepted = num == 2
    assert abs(accepted.mean() - p1[x]) < 4 * math.sqrt(p1[x] * (1 - p1[x]) / N)
    assert (tokens[accepted, 0] == x).all() and (tokens[~accepted, 0] != x).all()
    assert_follows(tokens[accepted, 1], p2)  # the bonus token follows the next row's p
    assert (tokens[~accepted, 1] == -1).all()
    assert (out.last.numpy() == tokens[np.arange(N), num - 1]).all()


def test_drafts_drawn_from_q_keep_the_targets() -> None:
    first, second, p1, p2 = target()
    q_logits = first.flip(0) * 0.8  # a draft that disagrees with the target
    q = q_logits.softmax(-1)
    rows = Rows(first, second)
    gen = torch.Generator().manual_seed(1)
    drafts = torch.multinomial(q.repeat(N, 1), 1, generator=gen).squeeze(1)
    v = rows.verification(drafts)
    v.draft_probs = DraftProbs(torch.arange(0, 2 * N, 2), q.repeat(N, 1))
    out = verify(rows.sampled(), v, rows.logits, rows)
    tokens, num = out.tokens.numpy(), out.num_tokens.numpy()
    assert_follows(tokens[:, 0], p1)
    expected_rate = np.minimum(p1, q.numpy()).sum()
    rate = (num == 2).mean()
    assert abs(rate - expected_rate) < 4 * math.sqrt(expected_rate * (1 - expected_rate) / N)
    assert_follows(tokens[num == 2, 1], p2)
    # accepted tokens are the drafts; the others were drawn again (never the draft where q
    # covers p there: max(p - q, 0) is 0 at the draft whenever q(x) >= p(x))
    accepted = num == 2
    assert (tokens[accepted, 0] == drafts.numpy()[accepted]).all()


def test_greedy_rows_accept_the_argmax_only() -> None:
    logits = torch.tensor([[0.1, 3.0, 0.2], [2.0, 0.0, 1.0], [0.0, 0.0, 5.0]])
    zero = torch.zeros(3)
    sampled = sample(logits, zero, None, None, None, torch.zeros(3, dtype=torch.int64), zero.long())
    # one request: drafts 1 (right) then 2 (wrong: the argmax is 0), bonus row unused
    v = Verification(np.array([3]), 3, torch.tensor([1, 2, -1]), torch.arange(3))
    out = verify(sampled, v)
    assert out.tokens.tolist() == [[1, 0, -1]] and out.num_tokens.tolist() == [2]
    assert out.kept.tolist() == [True, True, False]


@pytest.mark.parametrize("num_drafts", [1, 3])
def test_verification_rows_count_their_drafts_as_output(num_drafts: int) -> None:
    """Penalties on the row after drafts d1..dj are those of an output that ends with them:
    the same as a row whose request's counts hold them."""
    from minivllm.protocol.messages import NewRequestData
    from minivllm.protocol.sampling_params import SamplingParams
    from minivllm.worker.input_batch import InputBatch
    from minivllm.worker.logits_processors import LogitsProcessors
    from minivllm.worker.step_buffers import StepBuffers

    vocab, prompt, output = 16, [1, 2, 3], [4, 4, 5]
    drafts = [5, 6, 5][:num_drafts]  # a repeated draft counts twice
    params = SamplingParams(repetition_penalty=1.3, frequency_penalty=0.7, presence_penalty=0.4)
    batch = InputBatch(4, 64, 8)
    processors = LogitsProcessors(4, vocab, torch.device("cpu"))
    buffers = StepBuffers(4, 64, 8, 16, torch.device("cpu"), max_sample_rows=16)
    new = NewRequestData("r", prompt + output, len(prompt), params, [0], 0)
    row = batch.add(new).row
    processors.add(row, params, prompt + output, len(prompt), [])
    n = num_drafts + 1
    rows = np.full(n, row)
    positions = np.arange(n) + len(prompt) + len(output)
    before = [drafts[:j] for j in range(n)]
    step = processors.prepare(rows, positions, batch, buffers.host, buffers.dev, before)
    logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(2)) * 3
    got = step.apply(logits.clone())
    for j in range(n):
        counts = torch.zeros(1, vocab, dtype=torch.int32)
        for token in output + drafts[:j]:
            counts[0, token] += 1
        mask = torch.zeros(1, vocab, dtype=torch.bool)
        mask[0, prompt] = True
        expected = apply_penalties_reference(
            logits[j : j + 1], torch.zeros(1, dtype=torch.int64), torch.tensor([1.3]),
            torch.tensor([0.7]), torch.tensor([0.4]), counts, mask,
        )  # fmt: skip
        torch.testing.assert_close(got[j : j + 1], expected)
