"""Paged KV memory with prefix caching.

The pool is cut into blocks of block_size tokens; each request owns a list of blocks (its block table).
A full block is identified by a chained hash: the hash of the previous block's hash and this block's
token ids, so equal hashes mean equal prefixes up to and including this block. Full blocks are shared
between requests through reference counts: a request whose prompt starts with blocks that are already
computed reuses them and skips their prefill. A hash is never trusted alone: the token ids and the
previous block are checked on every hit.

The API is symmetric: allocate() gives a sequence the blocks for its tokens when it is admitted (cached
ones first), append() gives it one more block when its newest token needs one, release() gives every block
back. A released block nobody holds keeps its content: if it holds nothing cached it is free to overwrite at
once; if it is in the prefix cache it becomes evictable, and evictable blocks are taken least recently used
first (a hit takes a block back, and its next release puts it at the back of the line). Blocks with nothing
cached are always taken before any cached block is evicted.

Each block's hash is computed once, when the block fills, and kept on the sequence (sequence.block_hashes):
admission looks a waiting prompt up with the hashes it already has, however often it is asked.

on_release, when given, is told of every request whose table release() gives back (finished, preempted or
aborted): the model runner frees the request's block-table row (model_runner.py's BlockTables).

With async_scheduling a request's newest tokens may be placeholders (sampled on the device, not read yet:
sequence.py's num_output_placeholders). num_tokens counts them, so each has its slot, but token_ids holds only the
tokens the host knows, and a block is hashed only once every token in it is known (hash_new_blocks reads
token_ids): no hash covers a placeholder; the hashes of a block that fills with one are made at a later step, once
it is read. The blocks registered (cache_full_blocks) and looked up (_cached_prefix) never reach a placeholder: a
computed token is known (the engine reads step N's tokens before step N + 1's are counted computed), and a request
is looked up only while it waits, when it has none.

host, when given, is a second tier's decisions (offload.py's HostKVTier; every rank's HostKVStore runs its copies).
An evicted cached block is stored there before its GPU block is taken (_take_free_block), and admission looks a
prompt's blocks up there once the GPU's prefix cache misses (allocate): each host hit takes a GPU block, enters the
prefix cache as a hit would, and is restored from host memory before the forward that reads it. stats["host_hits"]
counts them, stats["tokens_saved"] includes them.
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
    ref_count: int = 0  # how many block tables hold it; 0 = nobody: in `empty` or `evictable`
    hash: int | None = None  # its chained hash while it is in the prefix cache, else None
    parent: int | None = None  # the block before it when it was computed (None: the first block of a prompt)
    token_ids: tuple[int, ...] = ()  # the tokens it holds; a hit must match them and the parent, not only the hash
    parent_hash: int | None = None  # the hash of the block before it (the host tier checks it on a hit)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, on_release=None,
                 on_trim=None, host=None):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Blocks nobody holds, two ordered sets: first those with nothing cached, then the cached ones, least
        # recently used first. Taking a block takes from `empty` while it has any.
        self.empty: dict[int, None] = dict.fromkeys(range(num_blocks))
        self.evictable: dict[int, None] = {}
        self.cached: dict[int, int] = {}  # the prefix cache: block hash -> id of the block holding it
        self.stats = {"lookups": 0, "hits": 0, "tokens_saved": 0, "host_hits": 0}  # lookups and hits count blocks
        self.host = host if enable_prefix_caching else None  # the host tier, offload.py (None: none)
        self.num_hashed = 0  # block hashes computed (each block of a request once)
        self.on_release = on_release  # called with each request release() empties (None: nobody listens)
        self.on_trim = on_trim  # called with each request whose table trim() cut back

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)  # ceil(num_tokens / block_size)

    def can_allocate(self, request, num_tokens: int) -> bool:
        """Could request's block table grow to hold num_tokens tokens? A request that starts from nothing
        counts its prefix hits: a cached block that others hold costs no free block."""
        needed = self.blocks_for(num_tokens) - len(request.block_table)
        if self.enable_prefix_caching and not request.block_table:
            needed -= sum(self.blocks[b].ref_count > 0 for b, _ in self._cached_prefix(request))
        return needed <= self.num_free_blocks

    def can_allocate_empty(self, request, num_tokens: int) -> bool:
        """Could request's block table grow to num_tokens tokens with blocks that hold nothing cached? (A
        draft's block must not evict the prefix cache.) Taking blocks takes the empty ones first."""
        return self.blocks_for(num_tokens) - len(request.block_table) <= len(self.empty)

    def can_append(self, request) -> bool:
        """Is there room for request's newest token: a free slot in its last block, or a free block?"""
        return self.can_allocate(request, request.num_tokens)

    def append(self, request) -> None:
        """Make room for request's newest token: one more block when its last block is full."""
        self.allocate(request, request.num_tokens)

    def allocate(self, request, num_tokens: int) -> int:
        """Grow request's block table until it holds num_tokens tokens. A request that starts from nothing
        (admission) first takes the cached blocks its tokens begin with. Returns how many of its tokens those
        blocks hold: their K/V are already computed, so the caller skips them."""
        num_cached_tokens = 0
        if self.enable_prefix_caching and not request.block_table:
            hits = self._cached_prefix(request)
            for block_id, h in hits:
                block = self.blocks[block_id]
                if block.ref_count == 0:  # cached but evictable: a hit takes it back
                    del self.evictable[block_id]
                block.ref_count += 1
                request.block_table.append(block_id)
            restored = self._restore_from_host(request, len(hits)) if self.host is not None else 0
            request.num_cached_blocks = len(hits) + restored
            num_cached_tokens = request.num_cached_blocks * self.block_size
            full_blocks = (request.num_tokens - 1) // self.block_size
            self.stats["lookups"] += min(len(hits) + 1, full_blocks)  # every hit, and the miss that ended them
            self.stats["hits"] += len(hits)
            self.stats["host_hits"] += restored
            self.stats["tokens_saved"] += num_cached_tokens
        while len(request.block_table) * self.block_size < num_tokens:
            request.block_table.append(self._take_free_block())
        return num_cached_tokens

    def _restore_from_host(self, request, start: int) -> int:
        """After the GPU's prefix cache missed at block `start`, the request's next full blocks from the
        host tier, while it has them: each takes a GPU block (taking it may store an evicted one first: the copies
        run in the order asked), enters the prefix cache, and is queued to be copied back. -> how many."""
        tokens, size, hashes = request.token_ids, self.block_size, request.block_hashes
        restored = 0
        for i in range(start, (len(tokens) - 1) // size):  # never the last token, as _cached_prefix
            parent_hash = hashes[i - 1] if i > 0 else None
            block_tokens = tuple(tokens[i * size:(i + 1) * size])
            if hashes[i] in self.cached:  # on the GPU after all (another request's copy): not this tier's to give
                break
            slot = self.host.lookup(hashes[i], block_tokens, parent_hash)
            if slot is None:
                break
            block_id = self._take_free_block()
            block = self.blocks[block_id]
            block.hash, block.token_ids, block.parent_hash = hashes[i], block_tokens, parent_hash
            block.parent = request.block_table[-1] if request.block_table else None
            self.cached[hashes[i]] = block_id
            request.block_table.append(block_id)
            self.host.restore(slot, block_id)
            restored += 1
        return restored

    def hash_new_blocks(self, request) -> None:
        """Hash the request's full blocks that have no hash yet: each block once in the request's life."""
        tokens, size, hashes = request.token_ids, self.block_size, request.block_hashes
        for i in range(len(hashes), len(tokens) // size):  # token_ids: the known tokens (no placeholder)
            hashes.append(block_hash(hashes[-1] if hashes else None, tuple(tokens[i * size:(i + 1) * size])))
            self.num_hashed += 1

    def _cached_prefix(self, request) -> list[tuple[int, int]]:
        """The cached blocks the request's tokens begin with, as [(block id, hash)]. Full blocks only, and never
        the last token: its logits are needed, so it is always computed."""
        self.hash_new_blocks(request)
        tokens, size, hits, parent = request.token_ids, self.block_size, [], None
        for i in range((len(tokens) - 1) // size):
            h = request.block_hashes[i]  # computed once, kept on the request
            block_id = self.cached.get(h)
            if block_id is None:
                break  # a miss: compute from here on
            block = self.blocks[block_id]
            if block.token_ids != tuple(tokens[i * size:(i + 1) * size]) or block.parent != parent:
                break  # a hash collision: other tokens, or the same tokens after another prefix; never share it
            hits.append((block_id, h))
            parent = block_id
        return hits

    def _take_free_block(self) -> int:
        pool = self.empty or self.evictable  # nothing cached is lost while an empty block is left
        block_id = next(iter(pool))  # the oldest: of the evictable ones, the least recently used
        del pool[block_id]
        old = self.blocks[block_id]
        if old.hash is not None:  # its old content is about to be overwritten: it leaves the prefix cache
            del self.cached[old.hash]
            if self.host is not None:  # ... for the host tier, which keeps a copy
                self.host.store(block_id, old.hash, old.token_ids, old.parent_hash)
        self.blocks[block_id] = Block(block_id, ref_count=1)
        return block_id

    def cache_full_blocks(self, request) -> None:
        """After a forward: register the request's newly computed full blocks, so others can share them."""
        if not self.enable_prefix_caching:
            return
        self.hash_new_blocks(request)
        size = self.block_size
        for i in range(request.num_cached_blocks, request.num_computed_tokens // size):
            h = request.block_hashes[i]  # hashed once, when the block filled
            block = self.blocks[request.block_table[i]]
            if h not in self.cached and block.hash is None:  # the first copy computed is the one shared
                block.hash, block.token_ids = h, tuple(request.token_ids[i * size:(i + 1) * size])
                block.parent = request.block_table[i - 1] if i > 0 else None
                block.parent_hash = request.block_hashes[i - 1] if i > 0 else None
                self.cached[h] = block.block_id
        request.num_cached_blocks = max(request.num_cached_blocks, request.num_computed_tokens // size)

    def release(self, request) -> None:
        """Give back every block of request's table; a block nobody holds any more becomes free: at once if it
        holds nothing cached, else evictable, at the back of the least-recently-used line."""
        for block_id in reversed(request.block_table):  # the last blocks are the least likely to be shared: first
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                (self.evictable if block.hash is not None else self.empty)[block_id] = None
        request.block_table = []
        request.num_cached_blocks = 0  # its hashes stay: they depend on its tokens only
        if self.on_release is not None:
            self.on_release(request)

    def trim(self, request, num_tokens: int) -> int:
        """Give back the blocks of request's table past the first blocks_for(num_tokens): blocks taken for
        drafts that were rejected. They were never full of computed tokens, so never cached: each goes back empty.
        -> how many blocks went back."""
        keep = self.blocks_for(num_tokens)
        extra = request.block_table[keep:]
        for block_id in reversed(extra):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                (self.evictable if block.hash is not None else self.empty)[block_id] = None
        if extra:
            del request.block_table[keep:]
            if self.on_trim is not None:
                self.on_trim(request)
        return len(extra)

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (their content stays, but no request can hit it) and zero the stats."""
        for block in self.blocks:
            block.hash, block.parent, block.token_ids, block.parent_hash = None, None, (), None
        self.cached.clear()
        self.empty.update(self.evictable)  # nothing is cached any more: every free block is empty
        self.evictable.clear()
        self.stats = {"lookups": 0, "hits": 0, "tokens_saved": 0, "host_hits": 0}
        if self.host is not None:  # the host tier forgets its blocks too
            self.host.reset()

    def check_balance(self) -> None:
        """Every block is held (ref_count > 0) or free, once; every cached hash names the block holding it;
        and the host tier's slots balance."""
        held = {b.block_id for b in self.blocks if b.ref_count > 0}
        assert not held & set(self.empty) and not held & set(self.evictable) and not set(self.empty) & set(self.evictable)
        assert len(held) + len(self.empty) + len(self.evictable) == self.num_blocks
        assert all(self.blocks[b].hash == h for h, b in self.cached.items())
        assert all(self.blocks[b].hash is not None for b in self.evictable)
        if self.host is not None:
            self.host.check_balance()

    @property
    def free_blocks(self) -> dict[int, None]:
        """Every block nobody holds, in the order they would be taken."""
        return {**self.empty, **self.evictable}

    @property
    def num_free_blocks(self) -> int:
        return len(self.empty) + len(self.evictable)
