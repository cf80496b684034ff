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


def block_hash(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """The chained hash of a full block: it covers every token before it, through parent_hash."""
    return hash((parent_hash, token_ids))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.free_blocks: dict[int, None] = dict.fromkeys(range(num_blocks))  # an ordered set, oldest freed first
        self.ref_count = [0] * num_blocks  # how many block tables hold each block
        self.cached: dict[int, int] = {}  # block hash -> block holding that computed, full block
        self.block_key: dict[int, tuple] = {}  # cached block -> (hash, previous block, token ids), to check hits
        self.stats = {"lookups": 0, "hits": 0, "tokens_saved": 0}  # lookups and hits count blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)  # ceil(num_tokens / block_size)

    def can_allocate(self, request, num_tokens: int) -> bool:
        """Could request's block table grow to hold num_tokens tokens? (Counts no prefix hit: never too few.)"""
        return self.blocks_for(num_tokens) - len(request.block_table) <= len(self.free_blocks)

    def allocate(self, request, num_tokens: int) -> None:
        """Grow request's block table until it holds num_tokens tokens. A request that starts from nothing
        first takes the cached blocks its tokens begin with, and skips computing them."""
        if self.enable_prefix_caching and not request.block_table and request.num_computed_tokens == 0:
            self._reuse_cached_prefix(request)
        while len(request.block_table) * self.block_size < num_tokens:
            request.block_table.append(self._take_free_block())

    def _take_free_block(self) -> int:
        block = next(iter(self.free_blocks))  # the block freed longest ago
        del self.free_blocks[block]
        self._forget(block)  # its old content is about to be overwritten
        self.ref_count[block] = 1
        return block

    def _forget(self, block: int) -> None:
        if block in self.block_key:
            del self.cached[self.block_key.pop(block)[0]]

    def _reuse_cached_prefix(self, request) -> None:
        tokens, size = request.token_ids, self.block_size
        parent_hash, parent_block = None, None
        for i in range((len(tokens) - 1) // size):  # full blocks only, never the last token: its logits are needed
            block_tokens = tuple(tokens[i * size:(i + 1) * size])
            h = block_hash(parent_hash, block_tokens)
            self.stats["lookups"] += 1
            block = self.cached.get(h)
            if block is None or self.block_key[block] != (h, parent_block, block_tokens):
                break  # a miss, or a hash collision between different tokens: compute from here on
            if block in self.free_blocks:
                del self.free_blocks[block]
            self.ref_count[block] += 1
            request.block_table.append(block)
            request.block_hashes.append(h)
            parent_hash, parent_block = h, block
            self.stats["hits"] += 1
        request.num_computed_tokens = len(request.block_table) * size
        self.stats["tokens_saved"] += request.num_computed_tokens

    def cache_full_blocks(self, request) -> None:
        """After a forward: register the request's newly computed full blocks, so others can share them."""
        if not self.enable_prefix_caching:
            return
        tokens, size = request.token_ids, self.block_size
        for i in range(len(request.block_hashes), request.num_computed_tokens // size):
            parent_hash = request.block_hashes[i - 1] if i > 0 else None
            parent_block = request.block_table[i - 1] if i > 0 else None
            block_tokens = tuple(tokens[i * size:(i + 1) * size])
            h = block_hash(parent_hash, block_tokens)
            request.block_hashes.append(h)
            block = request.block_table[i]
            if h not in self.cached and block not in self.block_key:  # the first copy computed is the one shared
                self.cached[h] = block
                self.block_key[block] = (h, parent_block, block_tokens)

    def free(self, request) -> None:
        """Drop request's hold on its blocks; a block nobody holds returns to the free list (keeping its content)."""
        for block in reversed(request.block_table):  # the last blocks are the least likely to be shared: free them first
            self.ref_count[block] -= 1
            if self.ref_count[block] == 0:
                self.free_blocks[block] = None
        request.block_table = []
        request.block_hashes = []

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)
