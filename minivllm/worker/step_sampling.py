"""A step's sampled ids from the final hidden states of its sampling rows.

The rows' sampling parameters are already in the step buffers (host views for the decisions
made here, device views for the kernels). On CUDA the device sampler runs, skipping the
filters no row asks for; with tensor parallelism and no filters at all, each rank samples
its own slice of the vocabulary (`vocab_parallel_sampling`) instead of gathering the logits.
On the CPU the torch sampler runs.
"""

from __future__ import annotations

import torch

from minivllm.protocol.sampling_params import GREEDY_EPS
from minivllm.worker.step_buffers import StepBuffers


def compute_logits(model: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """Logits [N, vocab] of hidden [N, H]: 16-bit on CUDA (the device sampler reads them as
    they are; a float32 copy would cost a pass), float32 from the model elsewhere."""
    lm_head = getattr(model, "lm_head", None)
    if hidden.is_cuda and lm_head is not None:
        return lm_head.compute_logits(hidden)
    return model.compute_logits(hidden)


def sample_rows(
    model: torch.nn.Module, hidden: torch.Tensor, buffers: StepBuffers, tp_size: int
) -> torch.Tensor:
    """Sampled ids [N] on the device for the final hidden states [N, H] of the sampling rows."""
    if not hidden.is_cuda:
        return sample_logits(compute_logits(model, hidden), buffers)
    ns = hidden.shape[0]
    filters = filters_in_use(buffers, ns)
    lm_head = getattr(model, "lm_head", None)
    if tp_size > 1 and lm_head is not None and not any(filters):
        from minivllm.worker.vocab_parallel_sampling import sample_vocab_parallel

        d = buffers.dev
        return sample_vocab_parallel(
            lm_head, hidden, d.temperature[:ns], d.seeds[:ns], d.sample_positions[:ns]
        )
    return sample_logits(compute_logits(model, hidden), buffers, filters)


def filters_in_use(buffers: StepBuffers, ns: int) -> tuple[bool, bool, bool]:
    """Whether any of the first ns rows asks for top-k, top-p, min-p (host views)."""
    h = buffers.host
    return (
        bool((h.top_k[:ns] > 0).any()),
        bool((h.top_p[:ns] < 1.0).any()),
        bool((h.min_p[:ns] > 0.0).any()),
    )


def sample_logits(
    logits: torch.Tensor,
    buffers: StepBuffers,
    filters: tuple[bool, bool, bool] | None = None,
) -> torch.Tensor:
    """Sampled ids [N] on the logits' device for logits [N, vocab]. `filters` (top-k,
    top-p, min-p in use; read from the host views when None): a filter no row uses is
    skipped on the device, so without top-k/top-p sampling is one pass over the logits."""
    ns = logits.shape[0]
    d, h = buffers.dev, buffers.host
    if logits.is_cuda:
        from minivllm.worker.ops.sampling import sample

        use_top_k, use_top_p, use_min_p = filters or filters_in_use(buffers, ns)
        return sample(
            logits,
            d.temperature[:ns],
            d.top_k[:ns] if use_top_k else None,
            d.top_p[:ns] if use_top_p else None,
            d.min_p[:ns] if use_min_p else None,
            d.seeds[:ns],
            d.sample_positions[:ns],
        )
    from minivllm.worker.sampler import SamplingMetadata, sample

    temperature = h.temperature[:ns]
    meta = SamplingMetadata(
        temperature=d.temperature[:ns],
        top_k=d.top_k[:ns],
        top_p=d.top_p[:ns],
        min_p=d.min_p[:ns],
        seeds=d.seeds[:ns],
        positions=d.sample_positions[:ns],
        all_greedy=bool((temperature < GREEDY_EPS).all()),
        all_random=bool((temperature >= GREEDY_EPS).all()),
    )
    return sample(logits.float(), meta)
