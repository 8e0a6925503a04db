"""Vocabulary-sharded sampling (tensor parallelism) picks exactly the whole row's token.

Each rank samples its slice of the vocabulary (`sample_shard`); the best of the ranks'
bests, first on ties, must equal `sample` over the full row, for greedy and random rows and
any shard boundaries, padding columns included; for the kernel and for its torch reference.
On CPU the kernel runs through the Triton interpreter in a subprocess (TRITON_INTERPRET must
be set before triton is imported).
"""

from __future__ import annotations

import pytest
import torch

from tests.triton_interpreter import needs_triton, run_interpreted


def check_shards(device: str, vocab: int = 10_000, rows: int = 6) -> None:
    from minivllm.worker.ops.sampling import sample, sample_shard

    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(rows, vocab, generator=gen) * 3).to(device)
    logits[1, 17] = logits[1, 9_000] = 50.0  # a greedy tie across shards: the first wins
    temperature = torch.tensor([0.0, 0.0, 0.7, 1.0, 1.3, 0.6], device=device)
    seeds = torch.tensor([1, 2, 3, 4, 5, 6], device=device)
    positions = torch.tensor([10, 11, 12, 4_000, 5, 2**33 + 7], device=device)
    whole = sample(logits, temperature, None, None, None, seeds, positions)
    assert whole[1].item() == 17
    for tp in (2, 3):
        per_rank = -(-vocab // tp)
        vals, idxs = [], []
        for rank in range(tp):
            start, end = rank * per_rank, min((rank + 1) * per_rank, vocab)
            shard = torch.full((rows, per_rank), 1e4, device=device)  # padding must be ignored
            shard[:, : end - start] = logits[:, start:end]
            val, idx = sample_shard(shard, temperature, seeds, positions, start, end)
            vals.append(val)
            idxs.append(idx)
        winner = torch.stack(vals).argmax(0)
        picked = torch.stack(idxs).gather(0, winner[None]).squeeze(0)
        assert torch.equal(picked, whole), (tp, picked.tolist(), whole.tolist())


def test_sample_shard_reference() -> None:
    check_shards("cpu")  # without the interpreter: the torch paths


@needs_triton
def test_sample_shard_interpreted() -> None:
    run_interpreted(__file__)


@pytest.mark.gpu
def test_sample_shard_gpu() -> None:
    check_shards("cuda", vocab=151_936, rows=6)


if __name__ == "__main__":
    check_shards("cpu")
    print("ok")
