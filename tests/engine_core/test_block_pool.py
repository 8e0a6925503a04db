import pytest

from minivllm.engine_core.block_pool import BlockPool


def test_new_blocks_come_in_id_order_and_are_held():
    pool = BlockPool(10)
    blocks = pool.get_new_blocks(3)
    assert [b.block_id for b in blocks] == [0, 1, 2]
    assert all(b.ref_cnt == 1 for b in blocks)
    assert pool.num_free_blocks == 7
    assert pool.usage == pytest.approx(0.3)
    with pytest.raises(ValueError, match="only 7 are free"):
        pool.get_new_blocks(8)
    pool.free_blocks(blocks)
    assert pool.num_free_blocks == 10 and pool.usage == 0.0


def test_least_recently_freed_cached_block_is_evicted_first():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(4)
    hashes = [b"h0", b"h1", b"h2", b"h3"]
    pool.cache_full_blocks(blocks, hashes, 0, 4)
    pool.free_blocks([blocks[2]])
    pool.free_blocks([blocks[0]])
    pool.free_blocks([blocks[3], blocks[1]])
    # the queue is in free order, so block 2 goes first and loses its hash
    (taken,) = pool.get_new_blocks(1)
    assert taken is blocks[2]
    assert taken.block_hash is None and pool.get_cached_block(b"h2") is None
    assert pool.get_cached_block(b"h0") is blocks[0]
    assert [b.block_id for b in pool.get_new_blocks(3)] == [0, 3, 1]


def test_touch_revives_a_freed_cached_block():
    pool = BlockPool(3)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, [b"a", b"b"], 0, 2)
    pool.free_blocks(reversed(blocks))
    assert pool.num_free_blocks == 3
    hit = pool.get_cached_block(b"a")
    pool.touch([hit])
    assert hit.ref_cnt == 1 and pool.num_free_blocks == 2
    pool.touch([hit])  # shared by a second request
    assert hit.ref_cnt == 2 and pool.num_free_blocks == 2
    pool.free_blocks([hit])
    assert pool.num_free_blocks == 2
    pool.free_blocks([hit])
    assert pool.num_free_blocks == 3 and pool.get_cached_block(b"a") is hit


def test_duplicate_hash_keeps_the_first_block():
    pool = BlockPool(4)
    first, second = pool.get_new_blocks(1), pool.get_new_blocks(1)
    pool.cache_full_blocks(first, [b"x"], 0, 1)
    pool.cache_full_blocks(second, [b"x"], 0, 1)
    assert pool.get_cached_block(b"x") is first[0] and second[0].block_hash is None


def test_reset_prefix_cache_only_when_idle():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, [b"a", b"b"], 0, 2)
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(b"a") is blocks[0]
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache() is True
    assert pool.get_cached_block(b"a") is None and blocks[0].block_hash is None


def test_caching_disabled_caches_nothing():
    pool = BlockPool(4, enable_caching=False)
    blocks = pool.get_new_blocks(1)
    pool.cache_full_blocks(blocks, [b"a"], 0, 1)
    assert pool.get_cached_block(b"a") is None
