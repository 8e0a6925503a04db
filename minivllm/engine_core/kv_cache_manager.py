"""Per-request KV block tables on top of the block pool, with prefix caching.

Prefix-cache contract:
- A block is identified by a chained hash: sha256 over (parent block's hash, the token ids
  of this FULL block). Equal hashes mean equal token prefixes, so equal KV. Partial blocks
  are never cached. A LongRoPE sequence past its threshold (`Request.long_rope`) has other
  KV for the same tokens: its chain starts from another root. Hashes are kept on the
  request (`Request.block_hashes`) and extended incrementally as tokens arrive.
- `get_computed_blocks` finds the longest cached prefix of a request but never its whole
  token list: the last token is always computed, because the step that computes it is the
  one that samples the next token.
- `allocate_slots` takes references on the hit blocks, allocates new ones, and caches every
  block that becomes full with tokens whose KV the scheduled step computes.
- `free` drops the request's references; cached blocks stay reusable until evicted (LRU).

Sliding window (`sliding_window` W: every layer of the model attends at most W tokens back,
see sliding_windows.py): a step whose first new token is at position c reads no key before
c - W + 1, so `allocate_slots` first frees the request's blocks wholly behind that, leaving
None in their place in its block list (block tables keep their positions; the worker's table
keeps the old ids, which no windowed kernel reads). A freed block keeps its hash until
evicted, like any freed block. A prefix hit then needs only the blocks its window reaches:
`get_computed_blocks` takes the longest prefix whose last blocks, back to the first key the
next token attends, are all cached, and puts None before them; a block that was evicted
can never be part of a hit, and the window of a hit is always there. Only a model whose
every layer has a window frees blocks: the block table is shared by all layers, and a layer
that sees the whole context needs all of them.

Speculative decoding: a step that verifies draft tokens writes their KV into the request's
slots after its last token; the scheduler takes the rejected ones back by lowering
`num_computed_tokens`, and the next step writes over those slots (the blocks stay the
request's). No block is cached while it holds a draft's KV: only blocks full of known
tokens are hashed. `num_lookahead_tokens` reserves slots past a step's tokens that a draft
model writes while it proposes the next ones.
"""

from __future__ import annotations

import hashlib

import msgspec

from minivllm.engine_core.block_pool import BlockPool, KVCacheBlock
from minivllm.engine_core.request import Request

_ROOT_HASH = b""
_LONG_ROPE_ROOT_HASH = b"long_rope"


def hash_block(parent_hash: bytes, token_ids: list[int]) -> bytes:
    return hashlib.sha256(msgspec.msgpack.encode((parent_hash, token_ids))).digest()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        sliding_window: int | None = None,
    ) -> None:
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.sliding_window = sliding_window
        self.block_pool = BlockPool(num_blocks, enable_caching)
        # each request's blocks by position; None: freed, behind the sliding window
        self.req_to_blocks: dict[str, list[KVCacheBlock | None]] = {}
        self.num_cached_blocks: dict[str, int] = {}  # blocks of each request already hashed
        # cumulative, in tokens, counted when a lookup is used by a successful allocation
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    def fits_any_length(self, step_tokens: int) -> bool:
        """Whether a request alone fits whatever its length: under a sliding window, when the
        blocks one step of up to `step_tokens` new tokens holds (its window's and its new
        tokens') fit the cache. Otherwise a sequence is bounded by the whole cache."""
        if self.sliding_window is None:
            return False
        return cdiv(self.sliding_window - 1 + step_tokens, self.block_size) + 1 <= self.num_blocks

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock | None], int]:
        """The longest cached prefix of `request`, as (blocks, number of tokens), at most
        `num_tokens - 1` tokens; under a sliding window, blocks behind the window of the
        first token after it are None. Takes no reference: pass them to `allocate_slots`."""
        if not self.enable_caching:
            return [], 0
        self._update_block_hashes(request, request.num_tokens)
        max_blocks = (request.num_tokens - 1) // self.block_size
        if self.sliding_window is not None:
            return self._window_hit(request.block_hashes[:max_blocks])
        blocks: list[KVCacheBlock | None] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * self.block_size

    def _window_hit(self, hashes: list[bytes]) -> tuple[list[KVCacheBlock | None], int]:
        """The longest hit of n blocks whose blocks from `_first_needed(n * block_size)` on
        are all cached, scanning runs of cached blocks from the end."""
        get = self.block_pool.get_cached_block
        end = len(hashes)
        while end > 0:
            run: list[KVCacheBlock] = []
            first = self._first_needed(end * self.block_size)
            for i in range(end - 1, first - 1, -1):
                block = get(hashes[i])
                if block is None:
                    break
                run.append(block)
            else:  # blocks first..end-1 all cached
                return [None] * first + run[::-1], end * self.block_size
            end -= len(run) + 1  # a hit cannot end inside this run, nor at its gap
        return [], 0

    def _first_needed(self, num_computed: int) -> int:
        """The first block that the token at position `num_computed` attends (0 without a
        window): every block before it is wholly behind the window."""
        if self.sliding_window is None:
            return 0
        return max(0, num_computed - self.sliding_window + 1) // self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_new_computed_tokens: int = 0,
        num_lookahead_tokens: int = 0,
    ) -> list[int] | None:
        """Make room for `num_new_tokens` more tokens after the computed ones, and
        `num_lookahead_tokens` slots after those.

        `new_computed_blocks` / `num_new_computed_tokens` are a prefix hit from
        `get_computed_blocks` for a request that holds no blocks yet. Returns the ids of the
        newly allocated blocks (hit blocks excluded), or None, changing nothing, when there
        are not enough free blocks.
        """
        request_id = request.request_id
        req_blocks = self.req_to_blocks.get(request_id)
        if req_blocks is not None and self.sliding_window is None:
            # most decode steps, settled without the work below: the new tokens fit the blocks
            # the request holds (so it brings no prefix hit) and fill none that is not cached
            num_total = request.num_computed_tokens + num_new_tokens
            if num_total + num_lookahead_tokens <= len(req_blocks) * self.block_size and (
                not self.enable_caching
                or num_total // self.block_size <= self.num_cached_blocks[request_id]
            ):
                return []
        hits = new_computed_blocks or ()
        is_first = req_blocks is None
        if is_first:
            req_blocks = []
        elif self.sliding_window is not None:
            self._free_behind_window(req_blocks, request.num_computed_tokens)
        num_total = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        num_slots = num_total + num_lookahead_tokens
        num_new_blocks = cdiv(num_slots, self.block_size) - len(req_blocks) - len(hits)
        new_block_ids: list[int] = []
        if hits or num_new_blocks > 0:  # (a decode step mostly fits in the last block)
            num_new_blocks = max(num_new_blocks, 0)
            # hit blocks nobody holds are in the free queue: touching them uses free blocks too
            num_evictable_hits = sum(1 for b in hits if b is not None and b.ref_cnt == 0)
            if num_new_blocks + num_evictable_hits > self.block_pool.num_free_blocks:
                return None
            self.block_pool.touch(b for b in hits if b is not None)
            req_blocks.extend(hits)
            new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
            req_blocks.extend(new_blocks)
            new_block_ids = [b.block_id for b in new_blocks]
        if is_first:
            self.req_to_blocks[request_id] = req_blocks
            self.num_cached_blocks[request_id] = len(hits)
            if self.enable_caching:
                self.prefix_cache_queries += request.num_tokens
                self.prefix_cache_hits += num_new_computed_tokens

        if self.enable_caching:
            # only tokens already known can be hashed (async: the last one may be pending)
            num_known = min(num_total, len(request.all_token_ids))
            num_cached = self.num_cached_blocks[request_id]
            if num_known // self.block_size > num_cached:
                self._update_block_hashes(request, num_known)
                num_full = num_known // self.block_size
                self.block_pool.cache_full_blocks(
                    req_blocks, request.block_hashes, num_cached, num_full
                )
                self.num_cached_blocks[request_id] = num_full
        return new_block_ids

    def free(self, request: Request) -> None:
        """Release the request's blocks, last block first (see `BlockPool.free_blocks`)."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        self.block_pool.free_blocks(b for b in reversed(blocks) if b is not None)

    def _free_behind_window(self, blocks: list[KVCacheBlock | None], num_computed: int) -> None:
        """Free the blocks that no token from position `num_computed` on attends, oldest
        first; those freed before are None already, so the scan stops at the first None."""
        end = self._first_needed(num_computed)
        start = end
        while start > 0 and blocks[start - 1] is not None:
            start -= 1
        if start < end:
            self.block_pool.free_blocks(blocks[start:end])  # type: ignore[arg-type]
            blocks[start:end] = [None] * (end - start)

    def get_num_common_prefix_blocks(self, request_id: str, num_running: int) -> int:
        """How many leading blocks of this running request every running request holds: a
        block that all `num_running` of them reference is, by the hash chain, at the same
        position in every block table (as vLLM V1 finds a cascade attention prefix)."""
        n = 0
        for block in self.req_to_blocks.get(request_id, ()):
            if block is None or block.ref_cnt != num_running:
                break
            n += 1
        return n

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block ids by position; 0 stands in for a block freed behind the
        sliding window (any id would do: no kernel reads it)."""
        return [0 if b is None else b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    def _update_block_hashes(self, request: Request, num_tokens: int) -> None:
        hashes, size = request.block_hashes, self.block_size
        tokens = request.all_token_ids
        while (len(hashes) + 1) * size <= num_tokens:
            start = len(hashes) * size
            root = _LONG_ROPE_ROOT_HASH if request.long_rope else _ROOT_HASH
            parent = hashes[-1] if hashes else root
            hashes.append(hash_block(parent, tokens[start : start + size]))
