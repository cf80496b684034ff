"""Paged KV memory: the pool is cut into blocks of block_size tokens; each request owns a list of blocks.

A request's block table maps its logical blocks (tokens 0..15, 16..31, ...) to physical blocks anywhere
in the pool. Blocks are taken from a free list as the request grows and given back when it finishes or
is preempted: a request never reserves more than one partly filled block, and nothing is ever copied.
"""
from __future__ import annotations

from collections import deque


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_blocks: deque[int] = deque(range(num_blocks))  # physical block ids nobody owns

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)  # ceil(num_tokens / block_size)

    def can_allocate(self, request, num_tokens: int) -> bool:
        """Could request's block table grow to hold num_tokens tokens?"""
        return self.blocks_for(num_tokens) - len(request.block_table) <= len(self.free_blocks)

    def allocate(self, request, num_tokens: int) -> None:
        """Grow request's block table until it holds num_tokens tokens."""
        while len(request.block_table) * self.block_size < num_tokens:
            request.block_table.append(self.free_blocks.popleft())

    def free(self, request) -> None:
        """Give all of request's blocks back to the free list."""
        self.free_blocks.extend(request.block_table)
        request.block_table = []

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)
