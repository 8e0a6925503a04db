"""N-gram (prompt lookup) proposals, vLLM's rule: find the longest suffix of the request's
tokens, `min_n` to `max_n` tokens long, that occurred earlier in them (the earliest such
occurrence), and propose the up to k tokens that followed it.

It runs in the engine-core, on the token list the scheduler owns, right after a step's
tokens are appended: no second copy of each request's history lives in another process,
the request's grammar can cut a proposal where it refuses it in the same place, and a
proposal is only wanted once the request's latest tokens are known anyway.

Each request keeps an index from its `min_n`-grams to where they end, grown by the tokens
each step appends, so a lookup costs the matches of the last `min_n` tokens (usually none
or a few), not a scan of the context: speculation costs nothing where it cannot help.
"""

from __future__ import annotations

import numpy as np

# past this many earlier occurrences of the last min_n tokens, extend them with numpy
_VECTOR_CANDIDATES = 16


class _Index:
    """One request's tokens (a numpy copy) and, for each of its min_n-grams, the positions
    of their last tokens, in increasing order."""

    __slots__ = ("tokens", "num_tokens", "ends")

    def __init__(self) -> None:
        self.tokens = np.empty(256, dtype=np.int64)
        self.num_tokens = 0
        self.ends: dict[object, list[int]] = {}

    def extend(self, token_ids: list[int], min_n: int) -> None:
        start, end = self.num_tokens, len(token_ids)
        if end > len(self.tokens):
            grown = np.empty(max(end, 2 * len(self.tokens)), dtype=np.int64)
            grown[:start] = self.tokens[:start]
            self.tokens = grown
        self.tokens[start:end] = token_ids[start:end]
        ends = self.ends
        for i in range(max(start, min_n - 1), end):
            key = token_ids[i] if min_n == 1 else tuple(token_ids[i - min_n + 1 : i + 1])
            found = ends.get(key)
            if found is None:
                ends[key] = [i]
            else:
                found.append(i)
        self.num_tokens = end


class NgramProposer:
    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self._indexes: dict[str, _Index] = {}

    def propose(self, request_id: str, token_ids: list[int], k: int) -> list[int]:
        """Up to `k` tokens to follow `token_ids` (the request's, which only grow), or []."""
        index = self._indexes.get(request_id)
        if index is None:
            index = self._indexes[request_id] = _Index()
        min_n, n = self.min_n, len(token_ids)
        index.extend(token_ids, min_n)
        if k <= 0 or n <= min_n:
            return []
        key = token_ids[-1] if min_n == 1 else tuple(token_ids[-min_n:])
        ends = index.ends.get(key)
        if ends is None or len(ends) < 2:  # the suffix itself is the last entry
            return []
        end = self._longest_match(index.tokens, token_ids, ends)
        if end < 0:
            return []
        return token_ids[end + 1 : end + 1 + k]

    def _longest_match(self, tokens: np.ndarray, token_ids: list[int], ends: list[int]) -> int:
        """Of the earlier occurrences of the last min_n tokens (ending at `ends[:-1]`), the
        end of the earliest among those whose match with the suffix runs longest (capped at
        max_n); -1 if none. `tokens` is `token_ids` as numpy."""
        min_n, max_n, n = self.min_n, self.max_n, len(token_ids)
        candidates = ends[:-1]
        if min_n == max_n:
            return candidates[0]
        if len(candidates) > _VECTOR_CANDIDATES:
            c = np.asarray(candidates)
            lengths = np.full(len(c), min_n)
            alive = np.ones(len(c), dtype=bool)
            for m in range(min_n, max_n):
                back = c - m
                ok = alive & (back >= 0)
                ok &= tokens[np.maximum(back, 0)] == tokens[n - 1 - m]
                lengths += ok
                alive = ok
            return int(c[int(np.argmax(lengths))])  # argmax: the first of the longest
        best_len, best_end = 0, -1
        for end in candidates:
            length = min_n
            while (
                length < max_n
                and end - length >= 0
                and token_ids[end - length] == token_ids[n - 1 - length]
            ):
                length += 1
            if length > best_len:
                best_len, best_end = length, end
                if length == max_n:
                    break
        return best_end

    def forget(self, request_id: str) -> None:
        self._indexes.pop(request_id, None)
