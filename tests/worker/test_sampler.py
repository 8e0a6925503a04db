"""The torch sampler (the CPU path): greedy, filters, and per-request seeded draws."""

from __future__ import annotations

import torch

from minivllm.worker.ops.sampling import argmax_rows, sample_reference

VOCAB = 32


def sample(logits: torch.Tensor, meta: dict) -> torch.Tensor:
    return sample_reference(logits, **meta)


def make_meta(
    n: int,
    temperature: float | list[float] = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    seeds: list[int] | None = None,
    positions: list[int] | None = None,
) -> dict:
    temps = torch.tensor(temperature if isinstance(temperature, list) else [temperature] * n)
    return {
        "temperature": temps.float(),
        "top_k": torch.full((n,), top_k, dtype=torch.int32) if top_k else None,
        "top_p": torch.full((n,), top_p, dtype=torch.float32) if top_p < 1 else None,
        "min_p": torch.full((n,), min_p, dtype=torch.float32) if min_p else None,
        "seeds": torch.tensor(seeds if seeds is not None else [0] * n, dtype=torch.int64),
        "positions": torch.tensor(positions if positions is not None else list(range(n))),
    }


def random_logits(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, VOCAB, generator=torch.Generator().manual_seed(seed)) * 2


def test_greedy_is_argmax() -> None:
    logits = random_logits(8)
    assert torch.equal(sample(logits, make_meta(8, temperature=0.0)), logits.argmax(-1))


def test_greedy_rows_in_a_mixed_batch_are_argmax() -> None:
    logits = random_logits(6)
    temps = [0.0, 1.0, 0.0, 0.7, 1.5, 0.0]
    out = sample(logits, make_meta(6, temperature=temps))
    for row in (0, 2, 5):
        assert out[row] == logits[row].argmax()


def test_top_k_1_is_greedy() -> None:
    logits = random_logits(64)
    out = sample(logits, make_meta(64, temperature=1.3, top_k=1))
    assert torch.equal(out, logits.argmax(-1))


def test_seeded_rows_do_not_depend_on_the_batch() -> None:
    logits = random_logits(5)
    meta = make_meta(5, seeds=[11, 22, 33, 44, 55], positions=[3, 9, 0, 4, 17])
    together = sample(logits, meta)
    assert torch.equal(sample(logits, meta), together)
    for row in range(5):
        alone = make_meta(
            1, seeds=[meta["seeds"][row].item()], positions=[meta["positions"][row].item()]
        )
        assert sample(logits[row : row + 1], alone).item() == together[row].item()
    # reversed order, with a greedy row added: the same draws
    perm = [4, 3, 2, 1, 0]
    mixed = make_meta(
        6,
        temperature=[1.0] * 5 + [0.0],
        seeds=[meta["seeds"][i].item() for i in perm] + [0],
        positions=[meta["positions"][i].item() for i in perm] + [0],
    )
    out = sample(torch.cat([logits[perm], logits[:1]]), mixed)
    assert out[:5].tolist() == together[perm].tolist()


def test_draws_follow_the_distribution() -> None:
    n = 4000
    logits = random_logits(1, seed=3).expand(n, VOCAB).contiguous()
    out = sample(logits, make_meta(n, seeds=[5] * n, positions=list(range(n))))
    freq = torch.bincount(out, minlength=VOCAB).float() / n
    probs = logits[0].softmax(-1)
    # 4000 draws: a standard error of at most ~0.008 per token
    assert (freq - probs).abs().max() < 0.03


def _drawn(logits_row: torch.Tensor, n: int = 2000, **filters) -> set[int]:
    logits = logits_row.expand(n, VOCAB).contiguous()
    meta = make_meta(n, seeds=[9] * n, positions=list(range(n)), **filters)
    return set(sample(logits, meta).tolist())


def test_top_k_never_draws_outside_the_k_best() -> None:
    row = random_logits(1, seed=4)[0] * 0.2  # flat, so every token would appear unfiltered
    drawn = _drawn(row, top_k=5)
    assert drawn == set(row.topk(5).indices.tolist())


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1] + [0.0] * (VOCAB - 4)) + 1e-9
    row = probs.log()
    assert _drawn(row, top_p=0.65) == {0, 1}  # 0.4 < 0.65 <= 0.7
    assert _drawn(row, top_p=0.7 + 1e-3) == {0, 1, 2}
    assert _drawn(row, top_p=0.01) == {0}  # the top token always stays


def test_min_p_removes_tokens_below_a_fraction_of_the_best() -> None:
    probs = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05] + [0.0] * (VOCAB - 5)) + 1e-9
    assert _drawn(probs.log(), min_p=0.3) == {0, 1, 2}  # >= 0.3 * 0.4 = 0.12


def test_temperature_sharpens() -> None:
    row = random_logits(1, seed=6)[0] * 0.3
    cold = _drawn(row, n=500, temperature=0.05)
    hot = _drawn(row, n=500, temperature=1.0)
    assert len(cold) < len(hot)


def test_cpu_argmax_picks_the_first_maximum_like_torch() -> None:
    logits = random_logits(5)
    logits[1, 3] = logits[1, 9] = 100.0  # a tie: the first one wins
    logits[2, 7] = logits[2, 11] = float("nan")  # NaN is the maximum
    logits[3] = float("-inf")
    assert torch.equal(argmax_rows(logits), logits.argmax(-1))
    assert torch.equal(argmax_rows(logits[:, :8]), logits[:, :8].argmax(-1))
