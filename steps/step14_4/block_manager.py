"""Paged KV memory with prefix caching.

The pool is cut into blocks of block_size tokens; each request owns a list of blocks (its block table).
A full block is identified by a chained hash: the hash of the previous block's hash and this block's
token ids, so equal hashes mean equal prefixes up to and including this block. Full blocks are shared
between requests through reference counts: a request whose prompt starts with blocks that are already
computed reuses them and skips their prefill. A hash is never trusted alone: the token ids and the
previous block are checked on every hit.

A block whose reference count falls to 0 returns to the free list but keeps its content and its entry in
the prefix cache until the block is taken for new content (oldest freed first), so a later request can
still hit it.
"""
from __future__ import annotations

from dataclasses import dataclass


def block_hash(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """The chained hash of a full block: it covers every token before it, through parent_hash."""
    return hash((parent_hash, token_ids))


@dataclass
class Block:
    """One block of the pool: who holds it and, once it is full, computed and cached, what it holds."""

    block_id: int
    ref_count: int = 0  # how many block tables hold it; 0 = on the free list
    hash: int | None = None  # its chained hash while it is in the prefix cache, else None
    parent: int | None = None  # the block before it when it was computed (None: the first block of a prompt)
    token_ids: tuple[int, ...] = ()  # the tokens it holds; a hit must match them and the parent, not only the hash


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_blocks: dict[int, None] = dict.fromkeys(range(num_blocks))  # an ordered set, oldest freed first
        self.cached: dict[int, int] = {}  # the prefix cache: block hash -> id of the block holding it
        self.stats = {"lookups": 0, "hits": 0, "tokens_saved": 0}  # lookups and hits count blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)  # ceil(num_tokens / block_size)

    def can_allocate(self, request, num_tokens: int) -> bool:
        """Could request's block table grow to hold num_tokens tokens? A request that starts from nothing
        counts its prefix hits: a cached block that others hold costs no free block."""
        needed = self.blocks_for(num_tokens) - len(request.block_table)
        if self.enable_prefix_caching and not request.block_table:
            needed -= sum(self.blocks[b].ref_count > 0 for b, _ in self._cached_prefix(request.token_ids))
        return needed <= len(self.free_blocks)

    def allocate(self, request, num_tokens: int) -> int:
        """Grow request's block table until it holds num_tokens tokens. A request that starts from nothing
        first takes the cached blocks its tokens begin with. Returns how many of its tokens those blocks
        hold: their K/V are already computed, so the caller skips them."""
        num_cached_tokens = 0
        if self.enable_prefix_caching and not request.block_table:
            hits = self._cached_prefix(request.token_ids)
            for block_id, h in hits:
                block = self.blocks[block_id]
                if block.ref_count == 0:  # cached but free: take it back from the free list
                    del self.free_blocks[block_id]
                block.ref_count += 1
                request.block_table.append(block_id)
                request.block_hashes.append(h)
            num_cached_tokens = len(hits) * self.block_size
            full_blocks = (request.num_tokens - 1) // self.block_size
            self.stats["lookups"] += min(len(hits) + 1, full_blocks)  # every hit, and the miss that ended them
            self.stats["hits"] += len(hits)
            self.stats["tokens_saved"] += num_cached_tokens
        while len(request.block_table) * self.block_size < num_tokens:
            request.block_table.append(self._take_free_block())
        return num_cached_tokens

    def _cached_prefix(self, tokens: list[int]) -> list[tuple[int, int]]:
        """The cached blocks that tokens begin with, as [(block id, hash)]. Full blocks only, and never the
        last token: its logits are needed, so it is always computed."""
        size, hits = self.block_size, []
        parent_hash, parent = None, None
        for i in range((len(tokens) - 1) // size):
            block_tokens = tuple(tokens[i * size:(i + 1) * size])
            h = block_hash(parent_hash, block_tokens)
            block_id = self.cached.get(h)
            if block_id is None:
                break  # a miss: compute from here on
            block = self.blocks[block_id]
            if block.token_ids != block_tokens or block.parent != parent:
                break  # a hash collision: other tokens, or the same tokens after another prefix; never share it
            hits.append((block_id, h))
            parent_hash, parent = h, block_id
        return hits

    def _take_free_block(self) -> int:
        block_id = next(iter(self.free_blocks))  # the block freed longest ago
        del self.free_blocks[block_id]
        old = self.blocks[block_id]
        if old.hash is not None:  # its old content is about to be overwritten: it leaves the prefix cache
            del self.cached[old.hash]
        self.blocks[block_id] = Block(block_id, ref_count=1)
        return block_id

    def cache_full_blocks(self, request) -> None:
        """After a forward: register the request's newly computed full blocks, so others can share them."""
        if not self.enable_prefix_caching:
            return
        tokens, size = request.token_ids, self.block_size
        for i in range(len(request.block_hashes), request.num_computed_tokens // size):
            parent_hash = request.block_hashes[i - 1] if i > 0 else None
            block_tokens = tuple(tokens[i * size:(i + 1) * size])
            h = block_hash(parent_hash, block_tokens)
            request.block_hashes.append(h)
            block = self.blocks[request.block_table[i]]
            if h not in self.cached and block.hash is None:  # the first copy computed is the one shared
                block.hash, block.token_ids = h, block_tokens
                block.parent = request.block_table[i - 1] if i > 0 else None
                self.cached[h] = block.block_id

    def free(self, request) -> None:
        """Drop request's hold on its blocks; a block nobody holds returns to the free list (keeping its content)."""
        for block_id in reversed(request.block_table):  # the last blocks are the least likely to be shared: free first
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_blocks[block_id] = None
        request.block_table = []
        request.block_hashes = []

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (their content stays, but no request can hit it) and zero the stats."""
        for block in self.blocks:
            block.hash, block.parent, block.token_ids = None, None, ()
        self.cached.clear()
        self.stats = {"lookups": 0, "hits": 0, "tokens_saved": 0}

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)
