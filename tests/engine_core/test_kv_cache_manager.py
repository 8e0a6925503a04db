from minivllm.engine_core.kv_cache_manager import KVCacheManager
from minivllm.engine_core.request import Request
from minivllm.protocol.sampling_params import SamplingParams

BS = 4


def req(rid: str, prompt: list[int]) -> Request:
    return Request(rid, prompt, SamplingParams())


def start(kv: KVCacheManager, request: Request) -> list[int] | None:
    """Look up the prefix cache and allocate the rest of the prompt, as the scheduler does."""
    blocks, num_hit = kv.get_computed_blocks(request)
    ids = kv.allocate_slots(request, request.num_tokens - num_hit, blocks, num_hit)
    if ids is not None:
        request.num_computed_tokens = request.num_tokens
    return ids


def test_second_request_hits_a_shared_two_block_prefix():
    kv = KVCacheManager(10, BS)
    prefix = list(range(100, 108))
    a = req("a", prefix + [1, 2])
    assert start(kv, a) == [0, 1, 2]
    b = req("b", prefix + [3])
    blocks, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 8 and [x.block_id for x in blocks] == [0, 1]
    assert kv.allocate_slots(b, 1, blocks, num_hit) == [3]
    assert kv.get_block_ids("b") == [0, 1, 3]
    assert kv.prefix_cache_queries == 10 + 9 and kv.prefix_cache_hits == 8
    kv.free(a)
    kv.free(b)
    assert kv.num_free_blocks == 10


def test_full_prompt_hit_still_computes_the_last_token():
    kv = KVCacheManager(10, BS)
    a = req("a", list(range(8)))
    start(kv, a)
    _, num_hit = kv.get_computed_blocks(req("b", list(range(8))))
    assert num_hit == 4  # the second block holds the last token: recomputed
    _, num_hit = kv.get_computed_blocks(req("c", list(range(9))))
    assert num_hit == 8


def test_hashes_are_chained_so_equal_blocks_after_different_prefixes_miss():
    kv = KVCacheManager(10, BS)
    start(kv, req("a", [1, 1, 1, 1, 5, 6, 7, 8, 9]))
    _, num_hit = kv.get_computed_blocks(req("b", [2, 2, 2, 2, 5, 6, 7, 8, 9]))
    assert num_hit == 0


def test_freed_cached_blocks_are_reused_by_the_same_prefix():
    kv = KVCacheManager(10, BS)
    prompt = list(range(12)) + [99]
    a = req("a", prompt)
    start(kv, a)
    kv.free(a)
    assert kv.num_free_blocks == 10
    b = req("b", prompt)
    start(kv, b)
    assert b.request_id and kv.get_block_ids("b")[:3] == [0, 1, 2]
    assert kv.prefix_cache_hits == 12


def test_tail_of_a_freed_sequence_is_evicted_first():
    kv = KVCacheManager(4, BS)
    a = req("a", list(range(13)))  # blocks 0,1,2 full and cached, block 3 partial
    start(kv, a)
    kv.free(a)
    other = req("other", [50] * 4)
    assert start(kv, other) == [3]  # the uncached partial block goes first
    other2 = req("other2", [60] * 4)
    assert start(kv, other2) == [2]  # then the last full block of "a"
    _, num_hit = kv.get_computed_blocks(req("c", list(range(13))))
    assert num_hit == 8  # blocks 0 and 1 are still cached


def test_allocation_counts_hit_blocks_that_sit_in_the_free_queue():
    kv = KVCacheManager(4, BS)
    a = req("a", list(range(9)))  # 3 blocks, 2 cached
    start(kv, a)
    kv.free(a)
    filler = req("filler", [70] * 4)
    start(kv, filler)  # takes the partial block, 3 free left (2 of them cached hits)
    b = req("b", list(range(8)) + [1] * 8)  # hits 8 tokens, needs 2 more blocks
    blocks, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 8
    # 2 new + 2 revived hits = 4 > 3 free
    assert kv.allocate_slots(b, 8, blocks, num_hit) is None
    assert kv.num_free_blocks == 3 and kv.get_block_ids("b") == []
    assert kv.prefix_cache_queries == 9 + 4  # a failed allocation is not a query
    assert kv.allocate_slots(b, 4, blocks, num_hit) is not None
    assert kv.num_free_blocks == 0


def test_decode_blocks_are_cached_once_full():
    kv = KVCacheManager(10, BS)
    a = req("a", [1, 2, 3])
    start(kv, a)
    a.append_output_token(4)
    assert kv.allocate_slots(a, 1) == []  # position 3 fits in block 0
    a.num_computed_tokens += 1
    a.append_output_token(5)
    assert kv.allocate_slots(a, 1) == [1]
    a.num_computed_tokens += 1
    kv.free(a)
    _, num_hit = kv.get_computed_blocks(req("b", [1, 2, 3, 4, 5, 6]))
    assert num_hit == 4


def test_caching_disabled_never_hits():
    kv = KVCacheManager(10, BS, enable_caching=False)
    start(kv, req("a", list(range(9))))
    assert kv.get_computed_blocks(req("b", list(range(9)))) == ([], 0)
    assert kv.prefix_cache_queries == 0


def test_reset_prefix_cache():
    kv = KVCacheManager(10, BS)
    a = req("a", list(range(9)))
    start(kv, a)
    assert kv.reset_prefix_cache() is False
    kv.free(a)
    assert kv.reset_prefix_cache() is True
    assert kv.get_computed_blocks(req("b", list(range(9))))[1] == 0


def test_common_prefix_blocks_are_those_every_running_request_holds():
    kv = KVCacheManager(20, BS)
    prefix = list(range(100, 112))  # three full blocks
    a, b, c = req("a", prefix + [1, 2]), req("b", prefix + [3]), req("c", prefix[:8] + [4])
    for r in (a, b):
        start(kv, r)
    assert kv.get_num_common_prefix_blocks("a", 2) == 3
    assert kv.get_num_common_prefix_blocks("b", 2) == 3
    start(kv, c)  # shares only the first two blocks
    assert kv.get_num_common_prefix_blocks("a", 3) == 2
    kv.free(c)
    assert kv.get_num_common_prefix_blocks("a", 2) == 3
    # a request running alone holds all its blocks in common with itself
    kv.free(b)
    assert kv.get_num_common_prefix_blocks("a", 1) == 4
    assert kv.get_num_common_prefix_blocks("unknown", 1) == 0
