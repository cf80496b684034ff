"""CUDA graphs for the decode forward: record its kernels once per batch size, then replay them with one call.

A decode forward is a kernel launch for every operator of every layer (its matmuls, KV writes, attention and fused
kernels; step19 counts them per layer). Eager, the host launches each one: Python runs the model's code, torch
dispatches every operator, Triton binds every kernel's arguments; that host work takes longer than the kernels
themselves at small batches, so the GPU waits. A CUDA graph records the launches once (torch.cuda.graph: the
kernels, their arguments, the addresses they read and write) and replays the whole recording with one call
(graph.replay()): the host work of a forward becomes one launch.

A replay runs exactly what was recorded, so:

- the inputs must be at the same addresses every step: static buffers (StaticDecodeInputs) that the host
  refills before each replay (from pinned staging memory, copies queued without a wait);
- the shapes are fixed: one graph per batch size. Batches are padded up to the next captured size (a "bucket",
  graph_batch_sizes: 1, 2, 4, 8, then every 8 up to 256, then every 16); a padding row is a decode of one token
  whose K/V go to a scratch block that no sequence owns, so it writes nothing that matters and its logits are
  dropped;
- nothing in the recorded region may depend on host data that changes: RoPE's tables are precomputed (model.py),
  the attention metadata points at the static buffers (attention.py's graph_metadata), and flash decoding's split
  count is fixed per graph (chosen for the longest context the model takes);
- only steps of decodes are replayed (one token per row, the same shapes every step); a step with a prompt chunk
  has shapes of its own and runs eagerly.

On a CPU there are no CUDA graphs: DecodeGraphs runs the same fill-and-forward code eagerly (prepare() and launch()
without capture()), which is how its static buffers and padding are tested there.

The block tables come from the model runner's persistent rows (model_runner.py's BlockTables): fill() gathers the
step's rows into the staging with one index_select, and reads the slot mapping from them, never from the lists.
"""
from __future__ import annotations

import bisect

import torch


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """The batch sizes a graph is captured for: 1, 2, 4, 8, then every 8 up to 256, every 16 after that, and
    max_num_seqs itself last (so every batch the scheduler can form has a bucket)."""
    if isinstance(max_num_seqs, bool) or not isinstance(max_num_seqs, int) or max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be a positive int, got {max_num_seqs!r}")
    sizes, size = [1, 2, 4], 8
    while size < max_num_seqs:
        sizes.append(size)
        size += 8 if size < 256 else 16
    return sorted({s for s in sizes if s < max_num_seqs} | {max_num_seqs})


def padded_size(num_seqs: int, sizes: list[int]) -> int:
    """The smallest captured size that holds num_seqs rows (sizes ascending)."""
    i = bisect.bisect_left(sizes, num_seqs)
    if num_seqs < 1 or i == len(sizes):
        raise ValueError(f"a decode batch of {num_seqs} rows has no graph (captured sizes {sizes[0]}..{sizes[-1]})")
    return sizes[i]


class StaticDecodeInputs:
    """The tensors a captured decode forward reads, allocated once for the largest batch, and their host staging.

    On the device: two buffers, each refilled by one copy per step.
        longs [3, max_seqs] int64: input ids, positions, slot mapping (rows 0, 1, 2)
        ints  [max_seqs + max_seqs * max_blocks] int32: context lengths, then the block tables [max_seqs, max_blocks]
    plus constants of every decode step: cu_seqlens_q = 0, 1, .. (row i is sequence i), the tile map (tile i is
    sequence i, its token 0). A batch of `size` rows uses the first `size` entries of each; the block tables have
    a fixed width, max_blocks, because a graph replays the row stride it was recorded with. A row's entries past
    its context are never read, so they need no clearing.

    The staging copies are pinned (page-locked) on CUDA, so the copies are queued and the host goes on. The host
    may rewrite staging only once the copies of the step before have run. With async_scheduling the engine
    fills step N + 2 before it waits for step N + 1, so nothing else promises that: an event recorded behind each
    fill's copies (copied) is waited for before the next fill writes the staging. By then step N's results were read,
    and step N + 1's copies, queued right after them, have run or are about to: the wait is short."""

    def __init__(self, max_seqs: int, max_blocks: int, device: torch.device):
        self.max_seqs, self.max_blocks, self.device = max_seqs, max_blocks, device
        pin = device.type == "cuda"
        self.longs = torch.zeros(3, max_seqs, dtype=torch.int64, device=device)
        self.ints = torch.ones(max_seqs * (1 + max_blocks), dtype=torch.int32, device=device)
        self.host_longs = torch.zeros(3, max_seqs, dtype=torch.int64, pin_memory=pin)
        self.host_ints = torch.ones(max_seqs * (1 + max_blocks), dtype=torch.int32, pin_memory=pin)
        self.input_ids, self.positions, self.slot_mapping = self.longs  # views: [max_seqs] each
        self.seq_lens = self.ints[:max_seqs]
        self.block_tables = self.ints[max_seqs:].view(max_seqs, max_blocks)
        self.host_lens = self.host_ints[:max_seqs]
        self.host_tables = self.host_ints[max_seqs:].view(max_seqs, max_blocks)
        self.cu_seqlens_q = torch.arange(max_seqs + 1, dtype=torch.int32, device=device)
        self.tile_seq = torch.arange(max_seqs, dtype=torch.int32, device=device)
        self.tile_first = torch.zeros(max_seqs, dtype=torch.int32, device=device)
        self.copied = torch.cuda.Event() if pin else None  # recorded behind each fill's copies

    def fill(self, plan, tables, rows: list[int], size: int, block_size: int, scratch_block: int) -> None:
        """The decodes of the plan (scheduler.py's SchedulerOutput; each row: its newest token, the one without K/V
        yet; rows: their rows in the runner's BlockTables `tables`) into rows 0 .. S - 1, padding rows up to `size`:
        token 0 at position 0, its K/V written to the scratch block's first slot, a context of that one token (the
        block table row: the scratch block). The tables are the persistent rows, gathered; then the two copies,
        queued. The plan's placeholders (a newest token the host does not know): 0 here, its id written on the
        device afterwards (the runner's fill_placeholders)."""
        num, pad = plan.num_rows, size - plan.num_rows
        if not 0 < num <= size <= self.max_seqs:
            raise ValueError(f"fill: {num} sequences in a batch of {size} (at most {self.max_seqs})")
        if self.copied is not None:  # wait until the last fill's copies have read the staging
            self.copied.synchronize()
        positions, late = plan.starts, set(plan.placeholders)
        ids = [0 if i in late else known[0] for i, known in enumerate(plan.token_ids)]
        self.host_longs[:2, :size] = torch.tensor([ids + [0] * pad, positions + [0] * pad])
        self.host_longs[2, :num] = tables.slots(rows, self.host_longs[1, :num], [1] * num, block_size)
        self.host_longs[2, num:size] = scratch_block * block_size
        self.host_lens[:size] = torch.tensor([p + 1 for p in positions] + [1] * pad, dtype=torch.int32)
        self.copy_tables_and_queue(tables, rows, num, size, scratch_block)

    def copy_tables_and_queue(self, tables, rows: list[int], num: int, size: int, scratch_block: int) -> None:
        """The end of a fill: the rows' block tables gathered into the staging (padding rows: the scratch block),
        then the two copies queued."""
        gathered = tables.gather(rows, pinned=False)  # [num, widest], copied into the staging next
        if gathered.shape[1] > self.max_blocks:
            raise ValueError(f"a block table of {gathered.shape[1]} blocks is wider than the graphs' {self.max_blocks}")
        self.host_tables[:num, :gathered.shape[1]] = gathered
        self.host_tables[num:size, 0] = scratch_block
        self.longs.copy_(self.host_longs, non_blocking=True)  # 3 x max_seqs int64: one small copy
        used = self.max_seqs + size * self.max_blocks  # the lengths and the first `size` table rows, contiguous
        self.ints[:used].copy_(self.host_ints[:used], non_blocking=True)
        if self.copied is not None:
            self.copied.record()


class DecodeGraphs:
    """One CUDA graph per batch size for the decode forward; prepare() pads the batch and fills the static buffers,
    launch() replays the bucket's graph (or, on a CPU / before capture(), runs the same forward eagerly).

    model: the model with its KV cache bound (the graphs record the cache's addresses: capture after it is
    allocated); the attention backend must be the kernels' (TritonAttention: its metadata has device tensors only).
    scratch_block: a block of the cache no sequence owns, where padding rows write."""

    def __init__(self, model, device: torch.device, max_num_seqs: int, block_size: int, scratch_block: int,
                 max_blocks: int, max_context: int, sizes: list[int] | None = None):
        self.model, self.device, self.block_size, self.scratch_block = model, device, block_size, scratch_block
        self.sizes = sizes or graph_batch_sizes(max_num_seqs)
        self.inputs = StaticDecodeInputs(self.sizes[-1], max_blocks, device)
        backend = model.attention_backend
        self.num_splits = {size: backend.graph_num_splits(size, max_context) for size in self.sizes}
        self.metadata = {size: backend.graph_metadata(self.inputs, size, self.num_splits[size]) for size in self.sizes}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}  # each graph's output, [size, vocab]: rewritten by every replay
        self.replays = 0  # graph launches
        self.eager_runs = 0  # launch() without a graph (a CPU, or before capture)
        self.pool_bytes = 0  # device memory the graphs hold (their private memory pool), measured by capture()
        self.collectives: dict[int, tuple] = {}  # what each graph's capture counted of the all-reduces
        self.pool = None  # the graphs' memory pool, once captured (the verify graphs record into it too)

    def forward(self, size: int) -> torch.Tensor:
        """The model on the static buffers' first `size` rows: what a graph records, and the eager path."""
        inputs = self.inputs
        return self.model.forward(inputs.input_ids[:size], inputs.positions[:size], self.metadata[size])

    def capture(self) -> None:
        """Record one graph per size, the largest first: they share one memory pool, and each smaller graph fits
        in what the larger ones used. Before each capture one eager run of the same size (Triton compiles its
        kernels, cuBLAS picks its own: neither may happen inside a recording)."""
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved(self.device)
        pool = self.pool
        for size in reversed(self.sizes):
            self._fill_padding(size)
            self.forward(size)  # warm-up
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            counted = self.model.tp.counts()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[size] = self.forward(size)
            self.collectives[size] = tuple(b - a for a, b in zip(counted, self.model.tp.counts()))
            self.model.tp.add(tuple(-n for n in self.collectives[size]))  # recorded, not run: count per replay
            pool = graph.pool()
            self.graphs[size] = graph
        self.pool = pool
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()  # the warm-ups' memory goes back; the graphs' pool stays
        self.pool_bytes = torch.cuda.memory_reserved(self.device) - before

    def _fill_padding(self, size: int) -> None:
        """Every row a padding row: what a capture records with (the values do not matter, the addresses do)."""
        inputs = self.inputs
        inputs.longs.zero_()
        inputs.slot_mapping[:size] = self.scratch_block * self.block_size
        inputs.seq_lens.fill_(1)
        inputs.block_tables[:size, 0] = self.scratch_block

    def prepare(self, plan, tables, rows: list[int]) -> int:
        """Pad the plan's rows (no more than the largest size; rows: theirs in the BlockTables `tables`) to their
        bucket and fill the static buffers. -> the bucket."""
        size = padded_size(plan.num_rows, self.sizes)
        self.inputs.fill(plan, tables, rows, size, self.block_size, self.scratch_block)
        return size

    def launch(self, size: int, num_rows: int) -> torch.Tensor:
        """Replay the bucket's graph (eagerly: run its forward) on what prepare() filled. -> the logits of the
        real rows, [num_rows, vocab]: a view of the graph's output, rewritten by the next replay."""
        if size in self.graphs:
            self.graphs[size].replay()
            self.replays += 1
            self.model.tp.add(self.collectives[size])  # the recorded all-reduces ran again
            return self.logits[size][:num_rows]
        self.eager_runs += 1
        return self.forward(size)[:num_rows]


# ---- graphs for verify steps -----------------------------------------------------------------------------------
class StaticVerifyInputs(StaticDecodeInputs):
    """The static buffers of a verify step: every row is `query_len` tokens (k + 1: a request's newest token and up
    to k drafts), row i's at flat indices i * query_len ... A row with fewer drafts (or none: a plain decode) is
    padded at its end: the padding tokens take the next positions, write their K/V to the scratch block, and their
    logits are dropped. Causal attention keeps them harmless: a real token never attends to a later one. (A padding
    token past its request's blocks reads whatever the stale block-table entries point at, even values that
    overflow: only its own row sees them, and every operator but attention works row by row.) Padding
    rows of the batch are query_len padding tokens at positions 0 .. query_len - 1, over the scratch block."""

    def __init__(self, max_seqs: int, max_blocks: int, device: torch.device, query_len: int):
        super().__init__(max_seqs, max_blocks, device)
        self.query_len = q = query_len
        pin = device.type == "cuda"
        self.longs = torch.zeros(3, max_seqs * q, dtype=torch.int64, device=device)
        self.host_longs = torch.zeros(3, max_seqs * q, dtype=torch.int64, pin_memory=pin)
        self.input_ids, self.positions, self.slot_mapping = self.longs
        self.cu_seqlens_q = torch.arange(max_seqs + 1, dtype=torch.int32, device=device) * q

    def fill(self, plan, tables, rows: list[int], size: int, block_size: int, scratch_block: int) -> None:
        """The plan's rows, each n <= query_len new tokens, its request's newest (its newest token and its drafts);
        rows: theirs in the runner's BlockTables. Rows padded to query_len tokens, the batch to `size` rows, as the
        class says; then the two copies, queued."""
        q, num = self.query_len, plan.num_rows
        if not 0 < num <= size <= self.max_seqs:
            raise ValueError(f"fill: {num} sequences in a batch of {size} (at most {self.max_seqs})")
        if self.copied is not None:
            self.copied.synchronize()
        starts, counts = plan.starts, plan.query_lens
        ids, positions, real = [], [], []  # real: the flat index of every token that is not padding
        for i, (known, n, start) in enumerate(zip(plan.token_ids, counts, starts)):
            ids += known + [0] * (q - n)
            positions += range(start, start + q)
            real += range(i * q, i * q + n)
        ids += [0] * ((size - num) * q)
        positions += list(range(q)) * (size - num)
        self.host_longs[:2, :size * q] = torch.tensor([ids, positions])
        self.host_longs[2, :size * q] = scratch_block * block_size  # every padding token: the scratch block
        real = torch.tensor(real)
        self.host_longs[2, real] = tables.slots(rows, self.host_longs[1, real], counts, block_size)
        self.host_lens[:size] = torch.tensor([start + q for start in starts] + [q] * (size - num), dtype=torch.int32)
        self.copy_tables_and_queue(tables, rows, num, size, scratch_block)


class VerifyGraphs(DecodeGraphs):
    """One CUDA graph per batch size for the verify forward: every row query_len tokens (StaticVerifyInputs), the
    logits of every token returned. Recorded into the decode graphs' memory pool (pool), after them.

    Sizes: graph_batch_sizes(max_seqs), where max_seqs is the largest batch that drafts with a graph (the engine's
    choice); a larger batch, a prompt chunk in the step, or a row whose padding would pass the model's length
    runs its verify step eagerly."""

    def __init__(self, model, device: torch.device, max_seqs: int, query_len: int, block_size: int,
                 scratch_block: int, max_blocks: int, pool=None):
        self.query_len = query_len
        self.model, self.device, self.block_size, self.scratch_block = model, device, block_size, scratch_block
        self.sizes = graph_batch_sizes(max_seqs)
        self.inputs = StaticVerifyInputs(self.sizes[-1], max_blocks, device, query_len)
        backend = model.attention_backend
        self.num_splits = {size: 1 for size in self.sizes}  # several tokens per row: the mixed kernel, never split
        self.metadata = {size: backend.graph_metadata(self.inputs, size, 1, query_len) for size in self.sizes}
        self.every_row = torch.arange(self.sizes[-1] * query_len, device=device)  # logits of every token
        self.graphs, self.logits, self.collectives = {}, {}, {}
        self.replays = self.eager_runs = self.pool_bytes = 0
        self.pool = pool

    def forward(self, size: int) -> torch.Tensor:
        inputs, n = self.inputs, size * self.query_len
        return self.model.forward(inputs.input_ids[:n], inputs.positions[:n], self.metadata[size],
                                  self.every_row[:n])

    def _fill_padding(self, size: int) -> None:
        inputs, q = self.inputs, self.query_len
        inputs.longs.zero_()
        inputs.positions[:size * q] = torch.arange(q, device=self.device).repeat(size)
        inputs.slot_mapping[:size * q] = self.scratch_block * self.block_size
        inputs.seq_lens.fill_(q)
        inputs.block_tables[:size].fill_(self.scratch_block)

    def can_run(self, plan) -> bool:
        """The step's plan (scheduler.py's SchedulerOutput): every row its sequence's newest n <= query_len tokens (a
        row that samples or drafts: no prompt chunk before its end), whose padding stays inside the model's length
        and the block tables' width; no more rows than the largest graph."""
        q = self.query_len
        max_len = min(self.model.config.max_position_embeddings, self.inputs.max_blocks * self.block_size)
        return (plan.num_rows <= self.sizes[-1] and len(plan.sample_rows) + len(plan.drafts) == plan.num_rows
                and all(n <= q and start + q <= max_len for start, n in zip(plan.starts, plan.query_lens)))

    def prepare(self, plan, tables, rows: list[int]) -> int:
        size = padded_size(plan.num_rows, self.sizes)
        self.inputs.fill(plan, tables, rows, size, self.block_size, self.scratch_block)
        return size

    def graph_rows(self, query_lens: list[int], logits_rows: list[int]) -> list[int]:
        """The eager flat batch's token indices (logits_rows) -> the same tokens' rows in the graph's output."""
        where = [i * self.query_len + j for i, n in enumerate(query_lens) for j in range(n)]
        return [where[r] for r in logits_rows]
