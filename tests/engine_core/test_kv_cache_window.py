"""The KV cache manager under a sliding window: blocks behind the window go back to the pool
and are reused; prefix hits need (and get) only the blocks their window reaches."""

from __future__ import annotations

from minivllm.engine_core.kv_cache_manager import KVCacheManager
from minivllm.engine_core.request import Request
from tests.engine_core.test_kv_cache_manager import BS, req, start


def decode(kv: KVCacheManager, request: Request, token: int) -> list[int] | None:
    """One decode step: the token the last step sampled, then room for its KV."""
    request.append_output_token(token)
    ids = kv.allocate_slots(request, 1)
    if ids is not None:
        request.num_computed_tokens += 1
    return ids


def held(kv: KVCacheManager, request_id: str) -> list[int | None]:
    return [b and b.block_id for b in kv.req_to_blocks[request_id]]


def test_blocks_behind_the_window_go_back_to_the_pool_and_are_reused():
    kv = KVCacheManager(4, BS, sliding_window=5)
    a = req("a", list(range(10)))  # positions 0-9: blocks 0, 1, 2
    assert start(kv, a) == [0, 1, 2]
    # the token at position 10 attends to 6..10: block 0 (positions 0-3) is behind
    assert decode(kv, a, 10) == []
    assert held(kv, "a") == [None, 1, 2] and kv.num_free_blocks == 2
    assert kv.get_block_ids("a") == [0, 1, 2]  # 0 stands in for the freed block
    for t in (11, 12, 13, 14):  # position 12 needs a new block: the free one, or block 0
        decode(kv, a, t)
    assert held(kv, "a") == [None, None, 2, 3] and kv.num_free_blocks == 2
    # a sequence of 60 tokens (15 blocks) in a cache of 4, never holding more than 3
    for t in range(15, 60):
        assert decode(kv, a, t) is not None
        assert sum(b is not None for b in kv.req_to_blocks["a"]) <= 3
    assert len(kv.req_to_blocks["a"]) == 15
    b = req("b", [99] * 4)
    assert start(kv, b) is not None  # the freed blocks serve another request
    kv.free(a)
    kv.free(b)
    assert kv.num_free_blocks == 4


def test_freeing_stops_at_the_first_block_the_window_reaches():
    kv = KVCacheManager(10, 4, sliding_window=9)
    a = req("a", list(range(21)))
    start(kv, a)
    decode(kv, a, 21)  # position 21 attends to 13..21: blocks 3, 4, 5 stay, 0-2 go
    assert held(kv, "a") == [None, None, None, 3, 4, 5]


def test_a_prefix_hit_takes_only_the_blocks_its_window_reaches():
    kv = KVCacheManager(12, BS, sliding_window=6)
    prompt = list(range(100, 124))  # 6 full blocks
    a = req("a", prompt + [1])
    start(kv, a)
    b = req("b", prompt + [2, 3])
    blocks, num_hit = kv.get_computed_blocks(b)
    # the token at 24 attends to 19..24: blocks 4 and 5; the four before are not needed
    assert num_hit == 24
    assert [x and x.block_id for x in blocks] == [None, None, None, None, 4, 5]
    assert kv.allocate_slots(b, 3, blocks, num_hit) == [7]
    assert kv.get_block_ids("b") == [0, 0, 0, 0, 4, 5, 7]
    assert kv.req_to_blocks["a"][4].ref_cnt == 2
    kv.free(a)
    kv.free(b)
    assert kv.num_free_blocks == 12


def test_a_hit_survives_the_eviction_of_blocks_behind_its_window_but_not_inside_it():
    kv = KVCacheManager(8, BS, sliding_window=6)
    prompt = list(range(100, 124))  # blocks 0-5, and the partial block 6
    a = req("a", prompt + [1])
    start(kv, a)
    kv.free(a)  # all cached, in the free queue after block 7: its tail (6, 5, ...) goes first
    filler = req("filler", [7] * 12)
    assert start(kv, filler) == [7, 6, 5]  # block 5 was evicted: no hit can end past it
    blocks, num_hit = kv.get_computed_blocks(req("b", prompt + [2]))
    assert num_hit == 20  # blocks 3 and 4 cover the window of position 20
    assert [x and x.block_id for x in blocks] == [None, None, None, 3, 4]
    kv.free(filler)
    assert start(kv, req("filler2", [8] * 12)) == [4, 3, 2]  # 0 and 1 stay cached
    _, num_hit = kv.get_computed_blocks(req("c", prompt + [2]))
    assert num_hit == 8  # from the start, a hit needs no earlier blocks than its own


def test_without_a_window_a_hit_is_the_whole_prefix():
    kv = KVCacheManager(12, BS)
    prompt = list(range(100, 124))
    start(kv, req("a", prompt + [1]))
    blocks, num_hit = kv.get_computed_blocks(req("b", prompt + [2]))
    assert num_hit == 24 and [x.block_id for x in blocks] == [0, 1, 2, 3, 4, 5]
