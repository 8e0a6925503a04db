"""The logprobs and penalties kernels against their torch references (vLLM's formulas).

On CPU the kernels run through the Triton interpreter in a subprocess (TRITON_INTERPRET must
be set before triton is imported); on a GPU at the reference workload's shape, in bf16.
"""

from __future__ import annotations

import sys

import pytest
import torch

from tests.triton_interpreter import needs_triton, run_interpreted


def random_logits(rows: int, vocab: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(rows, vocab, generator=gen) * 3
    logits[0, 5 : vocab // 2] = float("-inf")  # a banned stretch, whole tiles of it
    logits[1, 7] = 40.0  # a clear winner
    return logits.to(dtype=dtype, device=device)


def check_logprobs(device: str, dtype: torch.dtype, rows: int, vocab: int, exact: bool) -> None:
    """`exact`: no ties among the top scores, so ids must match one for one (float32 input);
    in bf16 equal scores abound, so ids are checked through their scores."""
    from minivllm.worker.ops.logprobs import gather_logprobs, gather_logprobs_reference

    logits = random_logits(rows, vocab, dtype, device)
    chosen = torch.randint(0, vocab, (rows,), generator=torch.Generator().manual_seed(1))
    chosen = chosen.to(device)
    chosen[0] = 3
    for num in (0, 1, 5, 20):
        for normalize in (True, False):
            ids, values, ranks = gather_logprobs(logits, num, chosen, normalize)
            ref_ids, ref_values, ref_ranks = gather_logprobs_reference(
                logits, num, chosen, normalize
            )
            assert ids.dtype == torch.int32 and ranks.dtype == torch.int32
            assert values.shape == (rows, num + 1)
            torch.testing.assert_close(values, ref_values, rtol=0, atol=1e-4)
            # ranks by the logits themselves (the reference compares float32 logprobs, whose
            # rounding can merge two nearly equal logits of a large vocabulary)
            scores = logits.float()
            exact_ranks = (scores >= scores.gather(1, chosen[:, None])).sum(-1, dtype=torch.int32)
            assert torch.equal(ranks, exact_ranks)
            assert (ranks - ref_ranks).abs().max() <= 1
            assert torch.equal(ids[:, 0], ref_ids[:, 0])
            if exact:
                assert torch.equal(ids, ref_ids), (num, normalize)
            else:  # each id's own score is the value reported for it
                own = logits.float().gather(1, ids.long())
                if normalize:
                    own = own - logits.float().logsumexp(-1, keepdim=True)
                torch.testing.assert_close(own, values, rtol=0, atol=1e-4)


def check_penalties(device: str, dtype: torch.dtype, rows: int, vocab: int) -> None:
    from minivllm.worker.ops.penalties import apply_penalties, apply_penalties_reference

    gen = torch.Generator().manual_seed(2)
    requests = rows + 3
    counts = torch.randint(0, 4, (requests, vocab), generator=gen, dtype=torch.int32)
    counts *= torch.rand(requests, vocab, generator=gen) < 0.02
    mask = torch.rand(requests, vocab, generator=gen) < 0.02
    batch_rows = torch.randperm(requests, generator=gen)[:rows]
    rep = torch.rand(rows, generator=gen) + 0.5
    freq = torch.rand(rows, generator=gen) * 4 - 2
    pres = torch.rand(rows, generator=gen) * 4 - 2
    rep[0], freq[0], pres[0] = 1.0, 0.0, 0.0  # a row without penalties: converted only
    state = [t.to(device) for t in (batch_rows, rep, freq, pres, counts, mask)]
    logits = random_logits(rows, vocab, dtype, device)
    want = apply_penalties_reference(logits, *state)
    got = apply_penalties(logits, *state)
    assert got.dtype == torch.float32 and got.data_ptr() != logits.data_ptr()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert torch.equal(got[0], logits[0].float())
    if dtype == torch.float32:  # in place, as after a masking step
        same = logits.clone()
        assert apply_penalties(same, *state, in_place=True).data_ptr() == same.data_ptr()
        torch.testing.assert_close(same, want, rtol=1e-6, atol=1e-6)


def test_references_on_cpu() -> None:
    check_logprobs("cpu", torch.float32, 4, 1000, exact=True)
    check_penalties("cpu", torch.float32, 4, 1000)


@needs_triton
def test_kernels_interpreted() -> None:
    run_interpreted(__file__)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_gpu(dtype: torch.dtype) -> None:
    check_logprobs("cuda", dtype, 256, 151_936, exact=dtype == torch.float32)
    check_penalties("cuda", dtype, 256, 151_936)


if __name__ == "__main__":
    check_logprobs("cpu", torch.float32, 3, 9000, exact=True)
    check_penalties("cpu", torch.float32, 3, 5000)
    check_penalties("cpu", torch.bfloat16, 2, 3000)
    print("ok", file=sys.stderr)
