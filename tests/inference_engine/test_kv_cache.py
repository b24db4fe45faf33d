from __future__ import annotations

import pytest

from inference_engine.kv_cache import FreeBlockQueue, KVCacheBlock, KVCacheManager
from inference_engine.protocol import SamplingParams
from inference_engine.request import Request


def make_request(req_id: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(req_id, tokens, SamplingParams(max_tokens=8), cache_salt=salt)


def admit(manager: KVCacheManager, request: Request) -> int:
    """Allocate the whole prompt like the scheduler does; returns the cached token count."""
    hits, num_cached = manager.get_computed_blocks(request)
    assert manager.allocate_slots(request, request.num_tokens - num_cached, hits) is not None
    request.num_computed_tokens = request.num_tokens
    return num_cached


def test_free_queue_removes_from_the_middle_in_order():
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    queue.remove(blocks[2])
    assert queue.block_ids() == [0, 1, 3, 4]
    assert queue.popleft().block_id == 0
    queue.append(blocks[2])
    assert queue.block_ids() == [1, 3, 4, 2]
    assert queue.num_free_blocks == 4
    with pytest.raises(AssertionError):
        queue.append(blocks[2])


def test_allocate_and_free_restore_all_blocks():
    manager = KVCacheManager(num_blocks=8, block_size=4)
    request = make_request("a", list(range(10)))
    assert admit(manager, request) == 0
    assert len(manager.get_block_ids("a")) == 3
    assert manager.usage == pytest.approx(3 / 8)
    manager.free("a")
    assert manager.num_free_blocks == 8 and manager.usage == 0.0


def test_allocation_fails_without_side_effects():
    manager = KVCacheManager(num_blocks=2, block_size=4)
    request = make_request("a", list(range(12)))
    assert manager.allocate_slots(request, 12) is None
    assert manager.num_free_blocks == 2 and manager.get_block_ids("a") == []


def test_prefix_hit_shares_full_blocks_and_keeps_last_token_uncached():
    manager = KVCacheManager(num_blocks=16, block_size=4)
    admit(manager, make_request("a", list(range(12))))
    same = make_request("b", list(range(12)))
    # 12 tokens are 3 full blocks, but the last token must be computed: only 2 blocks hit
    assert admit(manager, same) == 8
    longer = make_request("c", list(range(12)) + [99, 98])
    assert admit(manager, longer) == 12
    assert manager.get_block_ids("c")[:3] == manager.get_block_ids("a")
    assert manager.blocks[manager.get_block_ids("a")[0]].ref_cnt == 3


def test_cache_salt_isolates_prefixes():
    manager = KVCacheManager(num_blocks=16, block_size=4)
    admit(manager, make_request("a", list(range(9)), salt="tenant-1"))
    assert admit(manager, make_request("b", list(range(9)), salt="tenant-2")) == 0
    assert admit(manager, make_request("c", list(range(9)))) == 0
    assert admit(manager, make_request("d", list(range(9)), salt="tenant-1")) == 8


def test_freed_blocks_stay_cached_until_evicted_lru():
    manager = KVCacheManager(num_blocks=4, block_size=2)
    admit(manager, make_request("old", [1, 2, 3]))
    manager.free("old")
    admit(manager, make_request("new", [5, 6, 7]))
    manager.free("new")
    assert admit(manager, make_request("hit", [1, 2, 9])) == 2
    manager.free("hit")
    # "new"'s prefix block was freed before the "hit" blocks: it is evicted first
    admit(manager, make_request("filler", [40, 41, 42, 43]))
    assert admit(manager, make_request("hit-again", [1, 2, 8])) == 2
    manager.free("hit-again")
    assert admit(manager, make_request("new-again", [5, 6, 7])) == 0
    manager.free("new-again")
    manager.free("filler")


def test_prefix_caching_can_be_disabled():
    manager = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    admit(manager, make_request("a", list(range(9))))
    assert admit(manager, make_request("b", list(range(9)))) == 0


def test_double_free_is_detected():
    manager = KVCacheManager(num_blocks=4, block_size=4)
    admit(manager, make_request("a", [1, 2, 3]))
    block = manager.req_to_blocks["a"][0]
    manager.free("a")
    manager.free("a")  # unknown request: a no-op
    block.ref_cnt = 0
    manager.req_to_blocks["x"] = [block]
    with pytest.raises(AssertionError):
        manager.free("x")


def test_a_block_that_decodes_fill_is_cached_in_the_step_that_fills_it():
    """Decoding one token a step, a request's block is registered for prefix hits by the
    allocation of the step that fills it (no new block is allocated then): a follow-up prompt
    that repeats the conversation finds it, even when the request ends right there."""
    manager = KVCacheManager(num_blocks=16, block_size=4)
    request = make_request("a", [1, 2, 3, 4, 5, 6])
    admit(manager, request)
    for token in (7, 8):  # the second block fills with the decode of token 8's input
        request.append_output_token(token)
        assert manager.allocate_slots(request, 1) == []
        request.num_computed_tokens += 1
    follow_up = make_request("b", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert admit(manager, follow_up) == 8
    assert manager.get_block_ids("b")[:2] == manager.get_block_ids("a")
