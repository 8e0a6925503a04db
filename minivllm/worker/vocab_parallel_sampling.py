"""Sampling with a vocabulary-parallel LM head, without gathering the logits.

With tensor parallelism each rank's LM head produces the logits of its slice of the
vocabulary. Gathering them costs every rank the whole [N, vocab] tensor each step (39 MB per
rank at 256 rows of a 151,936-token vocabulary, bf16). Gumbel-max sampling needs only each
row's best score, and its noise is keyed by the global token index: every rank samples its
slice (`sample_shard`), the ranks exchange two numbers per row, and the best of the bests is
the token sampling the whole row would pick. Filters (top-k, top-p, min-p) need the whole
row, so steps that use them gather the logits as before.
"""

from __future__ import annotations

import torch

from minivllm.worker.layers.embedding import ParallelLMHead
from minivllm.worker.ops.sampling import sample_shard


def sample_vocab_parallel(
    lm_head: ParallelLMHead,
    hidden: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
) -> torch.Tensor:
    """Token ids [N] int64 (the same on every rank) for the rows of `hidden` [N, H]."""
    local = torch.nn.functional.linear(hidden, lm_head.weight)
    val, idx = sample_shard(
        local, temperature, seeds, positions, lm_head.vocab_start, lm_head.vocab_end
    )
    # indices travel as float32 beside the scores (exact below 2^24; vocabularies are smaller)
    assert lm_head.vocab_size < 2**24
    both = lm_head.tp.gather(torch.stack([val, idx.float()])[None], dim=0)  # [tp, 2, N]
    winner = both[:, 0].argmax(0, keepdim=True)  # the first rank on ties: the lowest index
    return both[:, 1].gather(0, winner).squeeze(0).long()
