"""The sampler: the one way from a step's final hidden states to its sampled tokens.

`Sampler.__call__` takes the hidden states of the rows that sample and their
`SamplingMetadata`; the draw itself (greedy, temperature, min-p, top-k, top-p, seeded) is
`ops.sampling.sample`, a Triton kernel on CUDA and its torch reference elsewhere.

Tensor parallelism is handled here and nowhere else: every rank's LM head holds a slice of
the vocabulary. When no row filters, each rank draws from its own slice and the ranks
exchange two numbers per row (`sample_shard`: the noise is keyed by the global token index,
so the best of the ranks' bests is the token a draw over the whole row picks); otherwise
the logits are gathered and every rank samples the whole row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minivllm.worker.ops.sampling import sample, sample_shard
from minivllm.worker.step_buffers import StepBuffers


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

    @classmethod
    def from_buffers(cls, buffers: StepBuffers, n: int) -> SamplingMetadata:
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
        )

    @property
    def needs_whole_rows(self) -> bool:
        """Whether some row's draw depends on more than its own logits one by one."""
        return self.use_top_k or self.use_top_p or self.use_min_p


class Sampler:
    def __init__(self, tp_size: int) -> None:
        self.tp_size = tp_size

    def __call__(
        self, model: torch.nn.Module, hidden: torch.Tensor, meta: SamplingMetadata
    ) -> torch.Tensor:
        """Sampled ids int64 [N] on the device for the final hidden states [N, H]."""
        if self.tp_size > 1 and not meta.needs_whole_rows:
            return self._sample_vocab_parallel(model.lm_head, hidden, meta)
        return self.sample_logits(model.compute_logits(hidden), meta)

    def sample_logits(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """Sampled ids int64 [N] for the full-vocabulary logits [N, V]."""
        return sample(
            logits,
            meta.temperature,
            meta.top_k if meta.use_top_k else None,
            meta.top_p if meta.use_top_p else None,
            meta.min_p if meta.use_min_p else None,
            meta.seeds,
            meta.positions,
        )

    @staticmethod
    def _sample_vocab_parallel(
        lm_head: torch.nn.Module, hidden: torch.Tensor, meta: SamplingMetadata
    ) -> torch.Tensor:
        """Each rank draws from its slice of the vocabulary without gathering the logits
        (39 MB per rank at 256 rows of a 151,936-token vocabulary, bf16)."""
        local = torch.nn.functional.linear(hidden, lm_head.weight)
        val, idx = sample_shard(
            local,
            meta.temperature,
            meta.seeds,
            meta.positions,
            lm_head.vocab_start,
            lm_head.vocab_end,
        )
        # indices travel as float32 beside the scores (exact below 2^24; vocabularies are smaller)
        assert lm_head.vocab_size < 2**24
        both = lm_head.tp.gather(torch.stack([val, idx.float()])[None], dim=0)  # [tp, 2, N]
        winner = both[:, 0].argmax(0, keepdim=True)  # the first rank on ties: the lowest index
        return both[:, 1].gather(0, winner).squeeze(0).long()
