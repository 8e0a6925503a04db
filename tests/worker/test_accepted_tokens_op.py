"""The accepted-tokens kernel of a verification step against its torch reference and against
the rule itself: a request returns its rows' tokens up to and including the first row that
rejects its draft; rows past it are not kept and read -1 in the table.

On CPU the kernel runs through the Triton interpreter in a subprocess; on a GPU also at the
largest step (256 requests of 1 + 4 rows).
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from tests.triton_interpreter import needs_triton, run_interpreted


def random_step(counts: list[int], seed: int) -> tuple[torch.Tensor, ...]:
    """Rows of requests with the given row counts laid out as the runner does (request i's
    row j at slot i * width + j), tokens and acceptances drawn at random (acceptance likely,
    so long accepted runs occur); a request's last row never accepts."""
    gen = np.random.default_rng(seed)
    width = max(counts)
    slots = np.concatenate([np.arange(c) + i * width for i, c in enumerate(counts)])
    tokens = gen.integers(0, 1000, len(slots))
    accept = gen.random(len(slots)) < 0.8
    accept[np.cumsum(counts) - 1] = False
    return torch.from_numpy(tokens), torch.from_numpy(accept), torch.from_numpy(slots), width


def expected(counts: list[int], tokens, accept) -> tuple[list[list[int]], list[bool]]:
    """Each request's tokens by the rule, and which rows are kept."""
    out, kept, start = [], [], 0
    for c in counts:
        acc = accept[start : start + c].tolist()
        num = acc.index(False) + 1
        out.append(tokens[start : start + num].tolist())
        kept += [j < num for j in range(c)]
        start += c
    return out, kept


def check_accepted(device: str) -> None:
    from minivllm.worker.ops.accepted_tokens import accepted_tokens, accepted_tokens_reference

    cases = [[5], [1], [1, 1, 1], [5, 1, 3, 2, 5], [2] * 7, [5] * 256, [1, 5] * 100]
    for seed, counts in enumerate(cases):
        tokens, accept, slots, width = random_step(counts, seed)
        want_tokens, want_kept = expected(counts, tokens, accept)
        args = (tokens.to(device), accept.to(device), slots.to(device), len(counts), width)
        got = accepted_tokens(*args)
        ref = accepted_tokens_reference(*args)
        for g, r in zip(got, ref, strict=True):
            assert torch.equal(g.cpu(), r.cpu()), (counts, g, r)
        table, num_tokens, last, kept = (t.cpu() for t in got)
        assert [row[:n].tolist() for row, n in zip(table, num_tokens, strict=True)] == want_tokens
        assert (table == -1).sum() == len(counts) * width - sum(map(len, want_tokens))
        assert last.tolist() == [t[-1] for t in want_tokens]
        assert kept.tolist() == want_kept


def test_reference_on_cpu() -> None:
    from minivllm.worker.ops.accepted_tokens import accepted_tokens_reference

    # request 0 accepts both drafts (3 tokens), request 1 rejects its first (1 token)
    tokens = torch.tensor([7, 8, 9, 4, 5])
    accept = torch.tensor([True, True, False, False, False])
    slots = torch.tensor([0, 1, 2, 3, 4])
    table, num_tokens, last, kept = accepted_tokens_reference(tokens, accept, slots, 2, 3)
    assert table.tolist() == [[7, 8, 9], [4, -1, -1]]
    assert num_tokens.tolist() == [3, 1] and last.tolist() == [9, 4]
    assert kept.tolist() == [True, True, True, True, False]
    check_accepted("cpu")


@needs_triton
def test_kernel_interpreted() -> None:
    run_interpreted(__file__)


@pytest.mark.gpu
def test_kernel_gpu() -> None:
    check_accepted("cuda")


if __name__ == "__main__":
    check_accepted("cpu")
    print("ok", file=sys.stderr)
