"""Paged KV block bookkeeping on plain ints: free queue (LRU), ref counts, prefix caching.

Blocks hold ``block_size`` token slots each. A full block is keyed by a chained hash of
(parent hash, its token ids, the request's ``cache_salt``). Freed blocks keep their hash and sit
in the free queue until reused, least recently freed first, so later requests can still hit them.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Container, Iterable
from typing import Protocol


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None


class FreeBlockQueue:
    """Doubly linked list of free blocks: pop from the front (LRU), append at the back, and
    remove from the middle in O(1) when a cached free block is hit."""

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.head = KVCacheBlock(-1)
        self.tail = KVCacheBlock(-1)
        self.head.next_free = self.tail
        self.tail.prev_free = self.head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self.head.next_free
        if block is self.tail:
            raise ValueError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        if block.prev_free is None or block.next_free is None:
            raise AssertionError(f"block {block.block_id} is not in the free queue")
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        if block.prev_free is not None or block.next_free is not None:
            raise AssertionError(f"block {block.block_id} is already in the free queue")
        last = self.tail.prev_free
        last.next_free = block
        block.prev_free = last
        block.next_free = self.tail
        self.tail.prev_free = block
        self.num_free_blocks += 1

    def block_ids(self) -> list[int]:
        ids, block = [], self.head.next_free
        while block is not self.tail:
            ids.append(block.block_id)
            block = block.next_free
        return ids


class CacheableRequest(Protocol):
    req_id: str
    all_token_ids: list[int]
    num_computed_tokens: int
    cache_salt: str | None
    block_hashes: list[bytes]
    reads_whole_prompt: bool


def hash_block(parent_hash: bytes | None, token_ids: list[int], cache_salt: str | None) -> bytes:
    hasher = hashlib.sha256(parent_hash or b"")
    hasher.update(array("q", token_ids).tobytes())
    if cache_salt:
        hasher.update(b"\x00salt\x00" + cache_salt.encode())
    return hasher.digest()


class KVCacheManager:
    """Allocates and frees blocks for requests; blocks are shared by ref count on prefix hits."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached_blocks: dict[bytes, KVCacheBlock] = {}
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.req_to_block_ids: dict[str, list[int]] = {}
        # leading blocks of each request that already carry their hash
        self.num_hashed_blocks: dict[str, int] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (cached free blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_block_ids(self, req_id: str) -> list[int]:
        """The request's block table (do not modify it)."""
        return self.req_to_block_ids.get(req_id, [])

    def _update_block_hashes(self, request: CacheableRequest) -> None:
        hashes, tokens, size = request.block_hashes, request.all_token_ids, self.block_size
        while (len(hashes) + 1) * size <= len(tokens):
            start = len(hashes) * size
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block(parent, tokens[start : start + size], request.cache_salt))

    def get_computed_blocks(
        self, request: CacheableRequest, unwritten: Container[int] = ()
    ) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of full blocks for a request that holds no blocks yet, and its
        length in tokens, stopping at a block id in ``unwritten`` (blocks a step in flight is
        filling: cached as they were allocated, but not all written yet). Never covers the
        last token, so there is always something to compute. None for a request that
        ``reads_whole_prompt`` (its prompt logprobs need every position's logits)."""
        if not self.enable_prefix_caching or request.reads_whole_prompt:
            return [], 0
        self._update_block_hashes(request)
        max_blocks = (len(request.all_token_ids) - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.cached_blocks.get(block_hash)
            if block is None or block.block_id in unwritten:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def allocate_slots(
        self,
        request: CacheableRequest,
        num_new_tokens: int,
        computed_blocks: list[KVCacheBlock] | None = None,
        num_reserved_blocks: int = 0,
    ) -> list[int] | None:
        """Make room for ``num_new_tokens`` after the request's computed tokens (counting
        ``computed_blocks``, the prefix hits of a newly admitted request), leaving at least
        ``num_reserved_blocks`` free. Returns the new block ids, or None and changes nothing
        when there are not enough free blocks."""
        held = self.req_to_blocks.get(request.req_id, [])
        if not computed_blocks and not num_reserved_blocks:
            # a decode's common case: the request's last block has room for its new tokens
            num_tokens = request.num_computed_tokens + num_new_tokens
            if num_tokens <= len(held) * self.block_size:
                if self.enable_prefix_caching:
                    self._cache_full_blocks(request, held, num_tokens)
                return []
        computed_blocks = computed_blocks or []
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        num_needed = self.num_blocks_for(num_computed + num_new_tokens) - len(held)
        num_needed -= len(computed_blocks)
        # hits that sit in the free queue stop being free once we take them
        num_evictable_hits = sum(1 for block in computed_blocks if block.ref_cnt == 0)
        if max(num_needed, 0) > self.num_free_blocks - num_evictable_hits - num_reserved_blocks:
            return None
        blocks = self.req_to_blocks.setdefault(request.req_id, [])
        block_ids = self.req_to_block_ids.setdefault(request.req_id, [])
        for block in computed_blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1
            blocks.append(block)
            block_ids.append(block.block_id)
        new_blocks = [self._take_free_block() for _ in range(max(num_needed, 0))]
        blocks.extend(new_blocks)
        new_block_ids = [block.block_id for block in new_blocks]
        block_ids.extend(new_block_ids)
        if self.enable_prefix_caching:
            self._cache_full_blocks(request, blocks, num_computed + num_new_tokens)
        return new_block_ids

    def _take_free_block(self) -> KVCacheBlock:
        block = self.free_queue.popleft()
        if block.block_hash is not None:
            if self.cached_blocks.get(block.block_hash) is block:
                del self.cached_blocks[block.block_hash]
            block.block_hash = None
        block.ref_cnt = 1
        return block

    def _cache_full_blocks(
        self, request: CacheableRequest, blocks: list[KVCacheBlock], num_tokens: int
    ) -> None:
        """Register blocks that will be full once this step's ``num_tokens`` are written."""
        num_hashed = self.num_hashed_blocks.get(request.req_id, 0)
        num_full = num_tokens // self.block_size
        if num_full <= num_hashed:
            return
        self._update_block_hashes(request)
        num_full = min(num_full, len(request.block_hashes))
        for index in range(num_hashed, num_full):
            block, block_hash = blocks[index], request.block_hashes[index]
            if block.block_hash is None:
                block.block_hash = block_hash
                self.cached_blocks.setdefault(block_hash, block)
        self.num_hashed_blocks[request.req_id] = max(num_full, num_hashed)

    def uncache(self, block_ids: Iterable[int]) -> None:
        """Forget the prefix-cache entries of blocks whose KV will not all be written after all
        (a step that will not run them, or that failed): they were registered as they were
        allocated, and a request that hit them would read KV nobody computed."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.block_hash is None:
                continue
            if self.cached_blocks.get(block.block_hash) is block:
                del self.cached_blocks[block.block_hash]
            block.block_hash = None

    def free(self, req_id: str) -> None:
        """Release a request's blocks. Tail blocks go first into the free queue so that they are
        evicted before the shared prefix blocks."""
        self.req_to_block_ids.pop(req_id, None)
        self.num_hashed_blocks.pop(req_id, None)
        for block in reversed(self.req_to_blocks.pop(req_id, [])):
            block.ref_cnt -= 1
            if block.ref_cnt < 0:
                raise AssertionError(f"block {block.block_id} freed twice")
            if block.ref_cnt == 0:
                self.free_queue.append(block)
