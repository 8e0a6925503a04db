"""Paged KV blocks: reference counts, an LRU free queue, and the prefix-cache hash map.

Every block id in `0..num_blocks-1` is usable; none is reserved as a null block (workers
pad block tables with any id and mask by sequence length, and padded tokens have slot -1).

Cache contract: a block with `ref_cnt == 0` sits in the free queue but keeps its hash, so a
later request with the same prefix can `touch` it back into use. Only when
`get_new_blocks` pops it from the head of the queue is its hash evicted. Freed blocks go to
the tail, so the least recently freed cached block is the first to be evicted.

Blocks never used yet come before every freed one (as if all had been freed at start-up, in
id order), and their objects are made when first taken: nothing at start-up scales with the
number of blocks, which reaches hundreds of thousands on a large GPU.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None  # set while the block is in the prefix cache

    def __repr__(self) -> str:
        return f"KVCacheBlock({self.block_id}, ref_cnt={self.ref_cnt}, cached={self.block_hash is not None})"


class BlockPool:
    """All KV blocks of one engine and the map from block hash to cached block."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks: list[KVCacheBlock] = []  # those used so far: ids 0..len-1
        # the freed blocks by id, least recently freed first (behind the never-used ones)
        self.free_queue: OrderedDict[int, KVCacheBlock] = OrderedDict()
        self.cached_blocks: dict[bytes, KVCacheBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue) + self.num_blocks - len(self.blocks)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (cached free blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Take `n` free blocks, least recently freed first, evicting their cache entries."""
        if n > self.num_free_blocks:
            raise ValueError(f"cannot take {n} blocks, only {self.num_free_blocks} are free")
        fresh = min(n, self.num_blocks - len(self.blocks))
        blocks = [KVCacheBlock(i) for i in range(len(self.blocks), len(self.blocks) + fresh)]
        self.blocks.extend(blocks)
        for _ in range(n - fresh):
            _, block = self.free_queue.popitem(last=False)
            self._evict(block)
            blocks.append(block)
        for block in blocks:
            block.ref_cnt = 1
        return blocks

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        return self.cached_blocks.get(block_hash)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on cached blocks, pulling free ones out of the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_queue[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop a reference; unused blocks go to the queue tail in the order given.

        Callers pass a request's blocks in reverse so that its last blocks, the least likely
        to be shared, are evicted before its first ones.
        """
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue[block.block_id] = block

    def cache_full_blocks(
        self,
        blocks: list[KVCacheBlock | None],
        block_hashes: list[bytes],
        num_cached_blocks: int,
        num_full_blocks: int,
    ) -> None:
        """Register `blocks[num_cached_blocks:num_full_blocks]` under their hashes.

        A hash that is already cached (another request computed the same block at the same
        time) keeps its first block; the duplicate stays uncached and is freed normally.
        """
        if not self.enable_caching:
            return
        for i in range(num_cached_blocks, num_full_blocks):
            block, block_hash = blocks[i], block_hashes[i]
            if block is None:  # freed behind a sliding window before it could be cached
                continue
            if block.block_hash is not None or block_hash in self.cached_blocks:
                continue
            block.block_hash = block_hash
            self.cached_blocks[block_hash] = block

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused (False) while any block is in use."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached_blocks.clear()
        return True

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            if self.cached_blocks.get(block.block_hash) is block:
                del self.cached_blocks[block.block_hash]
            block.block_hash = None
