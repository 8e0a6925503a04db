"""Vocabulary-parallel token embedding and LM head.

Each rank holds a contiguous range of ceil(vocab / tp) rows; the last rank's range is
padded with zero rows when tp does not divide the vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minivllm.worker.distributed.parallel_state import TPGroup
from minivllm.worker.layers.weights import Loaded, narrow, shape_of
from minivllm.worker.ops.sampling import sample_shard


class VocabParallelEmbedding(nn.Module):
    """Token id -> hidden vector. Each rank looks up the ids in its range (zeros elsewhere)
    and an all-reduce sums the ranks' results into the full embedding."""

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        tp: TPGroup,
        params_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.rows_per_rank = -(-vocab_size // tp.size)
        self.vocab_start = tp.rank * self.rows_per_rank
        self.vocab_end = min(self.vocab_start + self.rows_per_rank, vocab_size)
        self.weight = nn.Parameter(
            torch.empty(self.rows_per_rank, hidden_size, dtype=params_dtype), requires_grad=False
        )
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: Loaded, shard_id: object = None) -> None:
        if shard_id is not None:
            raise ValueError(f"{type(self).__name__} is not stacked, got shard_id {shard_id!r}")
        expected = (self.vocab_size, param.shape[1])
        if shape_of(loaded) != expected:
            raise ValueError(f"checkpoint shape {shape_of(loaded)} != expected {expected}")
        rows = self.vocab_end - self.vocab_start
        param.data[:rows].copy_(narrow(loaded, 0, self.vocab_start, rows))
        param.data[rows:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        in_range = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local_ids = torch.where(in_range, input_ids - self.vocab_start, 0)
        out = F.embedding(local_ids, self.weight) * in_range.unsqueeze(-1).to(self.weight.dtype)
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Hidden -> logits over the vocabulary; each rank computes its range, then the ranges
    are gathered so every rank holds the full-vocabulary logits. `draw` samples without the
    gather."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.tp.gather(F.linear(hidden, self.weight), dim=-1)
        return logits[..., : self.vocab_size]

    def draw(
        self,
        hidden: torch.Tensor,
        temperature: torch.Tensor,
        seeds: torch.Tensor,
        positions: torch.Tensor,
    ) -> torch.Tensor:
        """The sampled ids [N] of the hidden rows [N, H], greedy or a seeded draw by row (no
        filter), with every rank drawing from its own slice of the vocabulary: the ranks
        exchange two numbers per row instead of the logits (39 MB per rank at 256 rows of a
        151,936-token vocabulary, bf16). The noise is keyed by the global token index, so
        the best of the ranks' bests is the token a draw over the whole row picks."""
        local = F.linear(hidden, self.weight)
        val, idx = sample_shard(
            local, temperature, seeds, positions, self.vocab_start, self.vocab_end
        )
        # indices travel as float32 beside the scores (exact below 2^24; vocabularies are smaller)
        assert self.vocab_size < 2**24
        both = self.tp.gather(torch.stack([val, idx.float()])[None], dim=0)  # [tp, 2, N]
        winner = both[:, 0].argmax(0, keepdim=True)  # the first rank on ties: the lowest index
        return both[:, 1].gather(0, winner).squeeze(0).long()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("ParallelLMHead computes logits: call compute_logits(hidden)")
