"""Prompt lookup proposes what vLLM's n-gram proposer does: the tokens after the earliest
earlier occurrence of the longest matching suffix (min_n to max_n tokens long)."""

from __future__ import annotations

import random

from minivllm.engine_core.ngram_proposer import NgramProposer


def vllm_proposal(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """vLLM's KMP over the reversed tokens (ngram_proposer.py's
    `_find_longest_matched_ngram_and_propose_tokens`), written out here as the reference."""
    total = len(tokens)
    if total < min_n:
        return []
    rev = tokens[::-1]
    lps = [0] * max_n
    longest = position = prev = 0
    i = 1
    while i < total:
        if rev[prev] == rev[i]:
            prev += 1
            if prev >= longest:
                longest, position = prev, i
            if i < max_n:
                lps[i] = prev
            if prev == max_n:
                prev = lps[max_n - 1]
            i += 1
        elif prev:
            prev = lps[prev - 1]
        else:
            i += 1
    if longest < min_n:
        return []
    start = total - 1 - position + longest
    return tokens[start : start + min(k, total - start)]


def test_proposals_equal_vllms_over_random_texts() -> None:
    rng = random.Random(0)
    for _ in range(2000):
        min_n = rng.randint(1, 3)
        max_n, k = rng.randint(min_n, 5), rng.randint(1, 5)
        vocab = rng.choice([2, 3, 5, 20])  # small ones: many candidates (the numpy path)
        tokens = [rng.randrange(vocab) for _ in range(rng.randint(1, 90))]
        proposer = NgramProposer(min_n, max_n)
        # the index grows with the tokens, as a request's do, step by step
        for cut in sorted(rng.choices(range(len(tokens) + 1), k=3)):
            proposer.propose("r", tokens[:cut], k)
        got = proposer.propose("r", tokens, k)
        assert got == vllm_proposal(tokens, min_n, max_n, k), (min_n, max_n, k, tokens)


def test_examples() -> None:
    p = NgramProposer(2, 3)
    # "3 4" occurred before, followed by 5 6 7
    assert p.propose("a", [1, 3, 4, 5, 6, 7, 8, 3, 4], 3) == [5, 6, 7]
    assert p.propose("b", [1, 3, 4, 5, 6, 7, 8, 3, 4], 9) == [5, 6, 7, 8, 3, 4]  # to the end
    assert p.propose("c", [1, 2, 3, 4, 5, 6], 3) == []  # nothing repeats
    assert p.propose("d", [9, 4, 1, 2, 4], 3) == []  # only one token matches: under min_n
    # the longest match wins over a later, shorter one
    assert p.propose("e", [7, 1, 2, 3, 50, 9, 2, 3, 60, 1, 2, 3], 1) == [50]
    assert p.propose("f", [5], 2) == [] and p.propose("g", [5, 5, 5], 0) == []
    p.forget("a")
    assert "a" not in p._indexes
