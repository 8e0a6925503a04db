"""Token sampling: greedy, or a seeded random draw after min-p, top-k and top-p.

On CUDA (or the Triton interpreter) one kernel draws without a host sync: a random row takes
argmax(logits / T + g) with g Gumbel noise from Philox keyed by (seed, position, vocab index),
so the same request at the same position draws the same token whatever else is in the batch.
Filters (min-p, then top-k, then top-p over what min-p and top-k kept, the vLLM order) become
one per-row threshold on the raw logits; the kernel skips tokens below it. Without top-k/top-p
the draw is one pass over the logits (plus a row max when min-p is given); with them a
torch.sort finds the thresholds, still on the device. `sample_shard` draws from one rank's
slice of the vocabulary. Elsewhere `sample_reference` gives the same semantics in torch.
"""

from __future__ import annotations

import torch

from minivllm.protocol.sampling_params import GREEDY_EPS
from minivllm.worker.ops._triton import (
    HAS_TRITON,
    interpreting,
    pdl,
    tl,
    triton,
    use_triton,
    wait_for_producers,
)

if HAS_TRITON:
    from triton.language.extra.cuda import libdevice
else:  # pragma: no cover - depends on the install
    libdevice = None

_QUARTER = 1024  # a tile is 4 quarters: one Philox call gives the 4 quarters' random numbers


@triton.jit
def _gumbel(u, FAST: tl.constexpr):
    """Gumbel noise from a uniform u in [0, 1), up to a constant (argmax ignores it).

    FAST (GPU): -log(E) with E = -log(1 - u) ~ Exp(1), from two MUFU log2 approximations
    instead of two full-precision logs, which made the sampler compute-bound; E is taken
    from a series where it is small (u < 2^-7), so the noise is exact where the row's
    maximum lives. Otherwise (the interpreter has no libdevice): -log(-log(u))."""
    if FAST:
        small = u + u * u * (0.5 + u * 0.3333333333333333)
        e = tl.where(u < 0.0078125, small, -0.6931471805599453 * libdevice.fast_log2f(1.0 - u))
        return -0.6931471805599453 * libdevice.fast_log2f(e)
    return -tl.log(-tl.log(u))


@triton.jit
def _gumbel_quarter(
    logits_row, idx, vocab_start, vocab_end, bits, greedy, inv_t, threshold, best_val, best_idx,
    FAST: tl.constexpr,
):  # fmt: skip
    # idx is a global vocabulary index; the row holds [vocab_start, vocab_end) of them
    mask = (idx >= vocab_start) & (idx < vocab_end)
    logit = tl.load(logits_row + (idx - vocab_start), mask=mask, other=float("-inf"))
    logit = logit.to(tl.float32)
    u = tl.random.uint_to_uniform_float(bits)
    z = tl.where(greedy, logit, logit * inv_t + _gumbel(u, FAST))
    z = tl.where(logit >= threshold, z, float("-inf"))
    better = z > best_val  # strict: each lane keeps its first maximum (lowest index)
    return tl.where(better, z, best_val), tl.where(better, idx, best_idx)


# The chunk counts vary with the number of rows every step: as plain (unspecialized) ints
# they never trigger a recompile in the middle of a run. vocab_start / vocab_end are fixed
# per model and rank: specialized, so the compiler knows their alignment.
@triton.jit(do_not_specialize=["tiles_per_chunk", "num_chunks"])
def _sample_kernel(
    logits_ptr, stride_row, temp_ptr, threshold_ptr, seed_ptr, pos_ptr, part_val_ptr,
    part_idx_ptr, vocab_start, vocab_end, tiles_per_chunk, num_chunks,
    QUARTER: tl.constexpr, HAS_THRESHOLD: tl.constexpr, FAST: tl.constexpr,
    PDL: tl.constexpr = False,
):  # fmt: skip
    wait_for_producers(PDL)
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    temp = tl.load(temp_ptr + row)
    greedy = temp < 1e-5  # GREEDY_EPS (a jit function reads no plain globals)
    inv_t = 1.0 / tl.where(greedy, 1.0, temp)
    threshold = float("-inf")
    if HAS_THRESHOLD:
        threshold = tl.where(greedy, float("-inf"), tl.load(threshold_ptr + row))
    seed = tl.load(seed_ptr + row)
    pos = tl.load(pos_ptr + row)
    offs = tl.arange(0, QUARTER)
    zero = tl.zeros([QUARTER], tl.uint32)
    pos_lo = zero + (pos & 0xFFFFFFFF).to(tl.uint32)
    pos_hi = zero + (pos >> 32).to(tl.uint32)
    logits_row = logits_ptr + row.to(tl.int64) * stride_row
    best_val = tl.full([QUARTER], float("-inf"), tl.float32)
    best_idx = tl.zeros([QUARTER], tl.int32)
    # tiles of the global vocabulary, so a shard draws exactly the noise the whole row would
    first_tile = vocab_start // (4 * QUARTER)
    end_tile = tl.cdiv(vocab_end, 4 * QUARTER)
    tile_start = first_tile + chunk * tiles_per_chunk
    for tile in range(tile_start, tl.minimum(tile_start + tiles_per_chunk, end_tile)):
        counter = (tile * QUARTER + offs).to(tl.uint32)
        bits = tl.philox(seed, counter, pos_lo, pos_hi, zero)  # one uint32 per quarter
        for q in tl.static_range(4):
            best_val, best_idx = _gumbel_quarter(
                logits_row, tile * 4 * QUARTER + q * QUARTER + offs, vocab_start, vocab_end,
                bits[q], greedy, inv_t, threshold, best_val, best_idx, FAST,
            )  # fmt: skip
    top = tl.max(best_val, 0)
    top_idx = tl.min(tl.where(best_val == top, best_idx, 2147483647), 0)
    tl.store(part_val_ptr + row * num_chunks + chunk, top)
    tl.store(part_idx_ptr + row * num_chunks + chunk, top_idx)


def keep_threshold(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
) -> torch.Tensor | None:
    """Per row, the smallest raw logit a random draw may pick (-inf: no filter); None when no
    filter was asked for. Filters apply to softmax(logits / T): min-p, top-k, then top-p."""
    if top_k is None and top_p is None:
        if min_p is None:
            return None
        # p_i >= min_p * p_max  <=>  l_i >= l_max + T * log(min_p)
        row_max = logits.amax(-1).float()
        bound = row_max + temperature * torch.log(min_p.clamp_min(1e-30))
        return torch.where(min_p > 0, bound, float("-inf"))
    sorted_logits = logits.float().sort(-1, descending=True).values
    t = temperature.clamp_min(GREEDY_EPS)[:, None]
    scaled = sorted_logits / t
    ranks = torch.arange(logits.shape[-1], device=logits.device)
    keep = torch.ones_like(scaled, dtype=torch.bool)
    if min_p is not None:
        probs = scaled.softmax(-1)
        keep &= probs >= min_p[:, None] * probs[:, :1]
    if top_k is not None:
        keep &= ranks[None, :] < torch.where(top_k > 0, top_k, logits.shape[-1])[:, None]
    if top_p is not None:
        probs = scaled.masked_fill(~keep, float("-inf")).softmax(-1)
        mass_before = probs.cumsum(-1) - probs
        keep &= (mass_before < top_p[:, None]) | (top_p[:, None] >= 1)
    last_kept = keep.sum(-1).clamp_min(1) - 1  # every filter keeps a prefix of the sorted row
    return sorted_logits.gather(1, last_kept[:, None]).squeeze(1)


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
    seeds: torch.Tensor,
    positions: torch.Tensor,
) -> torch.Tensor:
    """Token ids [N] int64 for logits [N, V], without a host sync.

    temperature [N] f32 (< 1e-5: greedy argmax, first index on ties); top_k [N] i32 (0: off);
    top_p [N] f32 (1: off); min_p [N] f32 (0: off); seeds [N] i64; positions [N] i64 (the
    position of the token being sampled). Pass None for a filter no row uses: with top_k and
    top_p both None the sampler is a single pass over the logits. CPU tensors (outside the
    Triton interpreter) go to `sample_reference`.
    """
    if not use_triton(logits):
        return sample_reference(logits, temperature, top_k, top_p, min_p, seeds, positions)
    num_rows, vocab = logits.shape
    threshold = keep_threshold(logits, temperature, top_k, top_p, min_p)
    part_val, part_idx = _sample_chunks(logits, temperature, threshold, seeds, positions, 0, vocab)
    if part_idx.shape[1] == 1:
        return part_idx[:, 0].long()
    return part_idx.gather(1, part_val.argmax(1, keepdim=True)).squeeze(1).long()


def sample_shard(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    vocab_start: int,
    vocab_end: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample` without filters on one rank's slice of the vocabulary.

    logits [N, >= vocab_end - vocab_start] hold the global indices [vocab_start, vocab_end)
    (columns past them, a shard's padding, are ignored). Returns each row's best score
    (logit / T + its Gumbel noise; the logit for greedy rows) as float32 and its global index
    as int64. The noise is the one `sample` draws for that global index, so the best of the
    ranks' bests (the first on ties) is exactly the token `sample` picks from the whole row.
    CPU tensors (outside the Triton interpreter) go to `sample_shard_reference`.
    """
    if not use_triton(logits):
        return sample_shard_reference(logits, temperature, seeds, positions, vocab_start, vocab_end)
    part_val, part_idx = _sample_chunks(
        logits, temperature, None, seeds, positions, vocab_start, vocab_end
    )
    best = part_val.argmax(1, keepdim=True)
    return part_val.gather(1, best).squeeze(1), part_idx.gather(1, best).squeeze(1).long()


def _sample_chunks(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    threshold: torch.Tensor | None,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    vocab_start: int,
    vocab_end: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel over ~1024 programs: per row and vocabulary chunk, the best score and its
    global index ([N, chunks] each)."""
    assert logits.stride(-1) == 1
    num_rows = logits.shape[0]
    tile = 4 * _QUARTER
    num_tiles = triton.cdiv(vocab_end, tile) - vocab_start // tile
    chunks = max(1, min(num_tiles, triton.cdiv(1024, max(1, num_rows))))
    tiles_per_chunk = triton.cdiv(num_tiles, chunks)
    part_val = torch.empty((num_rows, chunks), dtype=torch.float32, device=logits.device)
    part_idx = torch.empty((num_rows, chunks), dtype=torch.int32, device=logits.device)
    _sample_kernel[(num_rows, chunks)](
        logits, logits.stride(0), temperature, temperature if threshold is None else threshold,
        seeds, positions, part_val, part_idx, vocab_start, vocab_end, tiles_per_chunk, chunks,
        QUARTER=_QUARTER, HAS_THRESHOLD=threshold is not None, FAST=not interpreting(),
        num_warps=8, **pdl(logits),
    )  # fmt: skip
    return part_val, part_idx


def sample_reference(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
    seeds: torch.Tensor,
    positions: torch.Tensor,
) -> torch.Tensor:
    """`sample`'s semantics in plain torch, all rows at once (the CPU sampler). The Gumbel
    noise is a counter-based function of (seed, position, index) here too, but not the
    kernel's Philox numbers."""
    greedy_ids = argmax_rows(logits)
    is_random = temperature >= GREEDY_EPS
    if not bool(is_random.any()):
        return greedy_ids
    scores = filtered_scores(logits, temperature, top_k, top_p, min_p)
    scores += gumbel_noise(seeds, positions, 0, logits.shape[-1])
    return torch.where(is_random, argmax_rows(scores), greedy_ids)


def sample_shard_reference(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    vocab_start: int,
    vocab_end: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample_shard`'s semantics in plain torch: the noise of a global index is the one
    `sample_reference` draws for it, so the ranks' best agree with the whole row's draw."""
    logits = logits[:, : vocab_end - vocab_start]
    greedy = (temperature < GREEDY_EPS)[:, None]
    scores = filtered_scores(logits, temperature, None, None, None)
    noise = gumbel_noise(seeds, positions, vocab_start, logits.shape[-1])
    scores = torch.where(greedy, scores, scores + noise)
    best = argmax_rows(scores)[:, None]
    return scores.gather(1, best).squeeze(1), best.squeeze(1) + vocab_start


def filtered_scores(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
) -> torch.Tensor:
    """What a random draw picks from, float32 [N, V] (vLLM's processed logits): the logits
    divided by the temperature (1 for greedy rows), the tokens min-p, top-k and top-p remove
    at -inf (none on greedy rows)."""
    greedy = temperature < GREEDY_EPS
    scores = logits.float() / torch.where(greedy, 1.0, temperature)[:, None]
    threshold = keep_threshold(logits, temperature, top_k, top_p, min_p)
    if threshold is not None:
        threshold = torch.where(greedy, float("-inf"), threshold)
        scores = scores.masked_fill(logits < threshold[:, None], float("-inf"))
    return scores


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """argmax over the last dim; on the CPU through numpy, which is ~10x faster than
    torch's CPU argmax (1.7 ms against 0.16 ms for [256, 4096] float32). Both pick the first
    maximum, and NaN counts as the maximum in both."""
    if x.device.type == "cpu" and not x.requires_grad and x.dtype != torch.bfloat16:
        return torch.from_numpy(x.numpy().argmax(axis=-1))
    return x.argmax(dim=-1)


def _signed(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


_GOLDEN, _MIX1, _MIX2 = (
    _signed(0x9E3779B97F4A7C15),
    _signed(0xBF58476D1CE4E5B9),
    _signed(0x94D049BB133111EB),
)


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _splitmix(x: torch.Tensor) -> torch.Tensor:
    # int64 products wrap around, which is the arithmetic splitmix64 wants
    x = (x ^ _shr(x, 30)) * _MIX1
    x = (x ^ _shr(x, 27)) * _MIX2
    return x ^ _shr(x, 31)


def gumbel_noise(
    seeds: torch.Tensor, positions: torch.Tensor, vocab_start: int, width: int
) -> torch.Tensor:
    """Gumbel noise float32 [N, width], element (r, i) a fixed function of (seeds[r],
    positions[r], vocab_start + i): a row's draw never depends on the rest of the batch, and
    all rows are drawn in a few vectorized ops."""
    row_key = _splitmix(seeds.long() * _GOLDEN + positions.long())
    index = torch.arange(vocab_start, vocab_start + width, device=seeds.device)
    bits = _splitmix(row_key[:, None] + (index[None, :] + 1) * _GOLDEN)
    # 24 random bits -> a uniform in (0, 1), never 0 or 1: the top value rounds to 1.0 in
    # float32, whose infinite noise would turn a banned (-inf) logit into NaN, the argmax
    uniform = ((_shr(bits, 40).float() + 0.5) * (1.0 / (1 << 24))).clamp_max(1.0 - 2.0**-24)
    return -torch.log(-torch.log(uniform))


def uniform_noise(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """A uniform float32 [N] in (0, 1) per row, a fixed function of (seeds[r], positions[r])
    (give it seeds salted otherwise than the draws' to keep it apart from their noise)."""
    bits = _splitmix(_splitmix(seeds.long() * _GOLDEN + positions.long()))
    return (_shr(bits, 40).float() + 0.5) * (1.0 / (1 << 24))
