"""A second tier for the KV cache, in host memory.

The prefix cache (block_manager.py) keeps a request's full blocks after it finishes, until the pool needs them: then
the least recently used is evicted, and a later request that begins with those tokens computes them again. Chat
clients send the whole conversation every turn, so with many conversations the pool keeps evicting the histories
their next turns will need. Host memory is tens of times larger than the pool.

The tier has two halves, as a step has (the scheduler decides, every rank's runner executes):

HostKVTier, beside the block manager, decides. It holds no tensor: host slots keyed by the blocks' chained hashes,
least recently used first, and the copies asked for.
    store(block, hash, ...)    the block manager is about to overwrite an evicted prefix block: its content is to be
                               copied to a host slot first (nothing to copy when the tier already holds that hash).
                               A full tier drops its least recently used block.
    lookup(hash, ...)          a GPU miss: is the block in host memory? The tokens and the previous block's hash are
                               checked, as a GPU hit checks them: a hash alone is never trusted.
    restore(slot, block)       a host block is to be copied back into a GPU block, before the forward that reads it.
    copies()                   every copy asked for since the last call, in order: the next step carries them.

HostKVStore, on every rank, executes: its host blocks (pinned on CUDA, so the copies run asynchronously) hold its
own share of each block's K and V for every layer (and an int8 cache's scales). run(copies) copies in the order
asked: on CUDA on a side stream that first waits for the work already queued (the block's content is final) and
that the forward's stream then waits for (nothing reads or overwrites a block before its copy); on a CPU, at once.
With tensor parallelism every rank receives the same copies with its step and runs them on its own shard.

Order is the whole correctness argument. Copies run in the order they were asked for, on one stream: a block
evicted, then restored into the same GPU block; a host slot restored from, then reused for another block; a block
restored, released by an abort and evicted again: each copy sees what the ones before it left. The model runner
runs a step's copies before its forward, so a forward never runs ahead of a copy it depends on.

Preemption needs nothing of its own here: a preempted request's full blocks go back to the prefix cache as any
finished request's do, so when they are evicted they are stored here, and when the request resumes its admission
finds them on the GPU or in this tier. Only the tokens of its last, partial block are computed again.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch


@dataclass
class HostEntry:
    slot: int
    token_ids: tuple[int, ...]
    parent_hash: int | None


def bytes_of(data: torch.Tensor) -> torch.Tensor:
    """The cache as the tier copies it: a float8 cache as its bytes (copies move bytes; not every device's copy
    kernels take float8), any other as it is."""
    return data.view(torch.uint8) if data.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else data


def block_bytes(kv_cache) -> int:
    """The bytes of one block of the cache, K and V of every layer (and an int8 cache's scales): a host slot's."""
    data, scales = kv_cache.data, kv_cache.scales
    per = data[:, :, 0].numel() * data.element_size()
    return per + (scales[:, :, 0].numel() * scales.element_size() if scales is not None else 0)


def available_host_memory() -> int | None:
    """The bytes the host can still give: /proc/meminfo's MemAvailable on Linux, else the free pages; None where
    neither is known."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # in kB
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):
        return None


def check_kv_offloading_size(size) -> float | None:
    """kv_offloading_size (vLLM's name): the host tier's size in GiB, a finite number no larger than the host memory
    available now (the tier allocates all of it at start); None or 0: no tier."""
    if size is None:
        return None
    if (isinstance(size, bool) or not isinstance(size, (int, float)) or size < 0
            or (isinstance(size, float) and not math.isfinite(size))):
        raise ValueError(f"kv_offloading_size must be a size in GiB >= 0 (or None: no host tier), got {size!r}")
    available = available_host_memory()
    if available is not None and size > available / 2**30:
        raise ValueError(f"kv_offloading_size={size!r} GiB is more than this host's available memory "
                         f"({available / 2**30:.1f} GiB)")
    return float(size) or None


class HostKVTier:
    """Which blocks host memory holds: num_slots slots, each keyed by the hash of the block it holds, least recently
    used first. The scheduler's side of the tier: it decides and queues copies, and holds no tensor; every rank's
    HostKVStore runs the copies (copies(): the queue, taken by the core for the next step)."""

    def __init__(self, num_slots: int, stats: dict | None = None):
        if num_slots < 1:
            raise ValueError("the host tier needs room for at least one block")
        self.num_slots = num_slots
        self.free = list(range(num_slots - 1, -1, -1))  # popped from the end: slot 0 first
        self.entries: dict[int, HostEntry] = {}  # hash -> entry, least recently used first
        self.queue: list[tuple[str, int, int]] = []  # ("out", block, slot) / ("in", slot, block), in the order asked
        # counted into the engine's stats when given: blocks stored, restored, dropped (a full tier's oldest),
        # looked up
        self.stats = stats if stats is not None else {}
        self.stats.update(host_blocks=num_slots, host_stores=0, host_restores=0, host_drops=0, host_lookups=0)

    def store(self, block_id: int, block_hash: int, token_ids: tuple[int, ...], parent_hash: int | None) -> None:
        """GPU block block_id, cached under block_hash, is about to be overwritten: keep its content here."""
        entry = self.entries.get(block_hash)
        if entry is not None and entry.token_ids == token_ids and entry.parent_hash == parent_hash:
            self.entries[block_hash] = self.entries.pop(block_hash)  # already held: the same content; now the newest
            return
        if entry is not None:  # the same hash for other tokens: a collision; the newer block takes the key
            self.free.append(self.entries.pop(block_hash).slot)
        if not self.free:  # full: drop the least recently used
            oldest = next(iter(self.entries))
            self.free.append(self.entries.pop(oldest).slot)
            self.stats["host_drops"] += 1
        slot = self.free.pop()
        self.entries[block_hash] = HostEntry(slot, token_ids, parent_hash)
        self.queue.append(("out", block_id, slot))
        self.stats["host_stores"] += 1

    def lookup(self, block_hash: int, token_ids: tuple[int, ...], parent_hash: int | None) -> int | None:
        """The host slot holding this block (the same tokens after the same previous block), or None."""
        self.stats["host_lookups"] += 1
        entry = self.entries.get(block_hash)
        if entry is None or entry.token_ids != token_ids or entry.parent_hash != parent_hash:
            return None  # absent, or a hash collision: other tokens, or the same tokens after another prefix
        self.entries[block_hash] = self.entries.pop(block_hash)  # the newest now
        return entry.slot

    def restore(self, slot: int, block_id: int) -> None:
        """Copy host slot `slot` into GPU block block_id before the next forward."""
        self.queue.append(("in", slot, block_id))
        self.stats["host_restores"] += 1

    def copies(self) -> list[tuple[str, int, int]]:
        """Every copy asked for since the last call, in order: the next step carries them to every rank."""
        queue, self.queue = self.queue, []
        return queue

    def reset(self) -> None:
        """Forget every host block (the prefix cache was reset); copies already asked for still run."""
        self.free = list(range(self.num_slots - 1, -1, -1))
        self.entries.clear()

    def check_balance(self) -> None:
        """Every slot is free or holds exactly one hash; no slot is both."""
        used = [e.slot for e in self.entries.values()]
        assert len(used) == len(set(used)), "a host slot holds two blocks"
        assert not set(used) & set(self.free), "a host slot is both free and used"
        assert len(used) + len(self.free) == self.num_slots, (len(used), len(self.free), self.num_slots)


class HostKVStore:
    """One rank's host blocks, shaped like its GPU cache's: data [slots, 2, layers, block_size, kv_heads, head_dim] in
    the cache's dtype (an fp8 cache as its bytes: bytes_of), and for an int8 cache its scales [slots, 2, layers,
    block_size, kv_heads]. It runs the copies HostKVTier decided, before the forward that follows them."""

    def __init__(self, kv_cache, num_slots: int, device: torch.device, stats: dict | None = None):
        self.kv_cache, self.device, self.num_slots = kv_cache, device, num_slots
        cuda = device.type == "cuda"
        data = bytes_of(kv_cache.data)  # [2, layers, blocks, block_size, kv_heads, head_dim]
        self.data = torch.zeros((num_slots, 2, data.shape[1], *data.shape[3:]), dtype=data.dtype, pin_memory=cuda)
        scales = kv_cache.scales
        self.scales = (torch.zeros((num_slots, 2, scales.shape[1], *scales.shape[3:]), dtype=scales.dtype,
                                   pin_memory=cuda) if scales is not None else None)
        self.stream = torch.cuda.Stream(device) if cuda else None
        self.stats = stats if stats is not None else {}  # the bytes this rank copied each way
        self.stats.update(host_bytes_out=0, host_bytes_in=0)

    @classmethod
    def sized(cls, kv_cache, size_gib: float, device: torch.device, stats: dict | None, tp) -> HostKVStore:
        """size_gib of host memory across the tensor-parallel ranks (vLLM's kv_offloading_size), this rank's share
        in whole blocks of its cache; every rank holds the same number of slots (the least any rank fits)."""
        per_block = block_bytes(kv_cache)
        slots = tp.agree_min(int(size_gib * 2**30 / tp.size) // per_block)
        if slots < 1:
            raise ValueError(f"kv_offloading_size={size_gib} GiB holds no block of the cache ({per_block} bytes a "
                             f"block{' on each rank' if tp.size > 1 else ''})")
        return cls(kv_cache, slots, device, stats)

    @property
    def bytes_per_block(self) -> int:
        return block_bytes(self.kv_cache)

    @property
    def nbytes(self) -> int:
        return self.bytes_per_block * self.num_slots

    def run(self, copies) -> int:
        """Run the copies, in order (see the module's docstring). -> how many."""
        if not copies:
            return 0
        if self.stream is None:
            self._copy(copies, non_blocking=False)
            return len(copies)
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)  # the blocks' content is what the work queued so far leaves
        with torch.cuda.stream(self.stream):
            self._copy(copies, non_blocking=True)
        current.wait_stream(self.stream)  # the next forward reads and writes the blocks after their copies
        return len(copies)

    def _copy(self, copies, non_blocking: bool) -> None:
        data, scales, per = bytes_of(self.kv_cache.data), self.kv_cache.scales, self.bytes_per_block
        for kind, a, b in copies:
            if kind == "out":  # GPU block a -> host slot b
                self.data[b].copy_(data[:, :, a], non_blocking=non_blocking)
                if scales is not None:
                    self.scales[b].copy_(scales[:, :, a], non_blocking=non_blocking)
                self.stats["host_bytes_out"] += per
            else:  # host slot a -> GPU block b
                data[:, :, b].copy_(self.data[a], non_blocking=non_blocking)
                if scales is not None:
                    scales[:, :, b].copy_(self.scales[a], non_blocking=non_blocking)
                self.stats["host_bytes_in"] += per

    def release(self) -> None:
        """The runner lets go: the copies already queued finish first, then the GPU cache and the host memory go."""
        if self.stream is not None:
            self.stream.synchronize()
        self.kv_cache, self.data, self.scales = None, None, None


def describe_host_tier(memory: dict, device) -> str:
    """The engine line's part for the host tier: its blocks and bytes over all ranks, or off."""
    if not memory.get("host_blocks"):
        return "host KV tier: off"
    return (f"host KV tier: {memory['host_blocks']} blocks ({memory['host_bytes'] / 2**20:.1f} MiB of "
            f"{'pinned ' if device.type == 'cuda' else ''}host memory, LRU), evicted prefix blocks stored there and "
            "restored on a hit")
