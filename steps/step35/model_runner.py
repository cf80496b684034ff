"""The model runner: the engine's one door to the model.

It owns the model and the KV cache (allocates it, sized from the device's memory), turns the step's plan (the
scheduler's SchedulerOutput: each row's request id, new tokens and block table, which rows are decodes, which sample
and how) into the tensors the model reads (input ids, positions, the slot mapping, and one AttentionMetadata that the
model's attention backend builds: attention.py), runs the forward, and samples the next tokens. The scheduler and the
block manager never touch a tensor; the runner reads the plan and nothing else of a request; the model never sees a
sequence.

The block tables live in BlockTables, one persistent row per running sequence (max_num_seqs rows, as wide
as the widest table can be: max_table_blocks). A step writes into the rows only the blocks appended since the
sequence's last step, and reads the step's block tables and slot mapping from the rows; the block manager tells
the rows when a sequence's blocks are released (its row is then free).

The cache may be int8 (kv_cache_dtype="int8"), and its size counts the scales: kv_bytes_per_token, from the
cache's KVSpec (kv_spec.py: what one token's cache holds).
It may also be float8 e4m3 (kv_cache_dtype="fp8"), one byte per element, one scale per layer.

CUDA graphs (cuda_graphs.py). After the cache is allocated the runner captures the decode forward once per
batch-size bucket (capture_graphs); a step of decodes only is then filled into static buffers and replayed, every
other step runs eagerly as before. The cache has one block more than the block manager hands out: the scratch
block padding rows write to. The memory the graphs hold is measured before the pool is sized (one trial capture of
the largest bucket) and left out of the pool. Sampling stays on the device; the step's one wait for the GPU is
the copy of the sampled tokens (and their logprobs) back to the host (read_back).

Tensor parallelism (parallel.py). Every rank has a model runner of its own, with its shard of the model and
its KV heads' cache; rank 0's is the engine's, and before each step it hands the step to the workers
(worker.py's Workers.start_step: the plan broadcast), which run the same execute on it. On CUDA the ranks
agree on the pool's size (the smallest any rank can hold), so a block id means the same slots on every rank. Rank 0
decides each sequence's block-table row and its new blocks (BlockTables.changes) and sends them with the step; every
rank writes them into its own rows, so every rank's rows hold the same tables.

Overlap scheduling (the engine's async_scheduling). The engine launches step N + 1 before it reads step N's
sampled tokens, so a sequence's newest input token may be a placeholder: sampled, not read by the host, not in its
token_ids (sequence.py's num_output_placeholders). The device knows it: after sampling, each sampled token is
written into last_token, one entry per block-table row (the row of the sequence it was sampled for). The engine
names the sequences whose last input is a placeholder (the plan's placeholders); their input ids are taken
on the device from their rows' entries (fill_placeholders), in the eager path and in the graphs' static inputs
alike. Sampling is cut in two halves:
launch_sample queues the work and the copies of its results to the host, behind an event; read_sampled waits for
that event and makes the lists. sample() is both at once, as before.
"""
from __future__ import annotations

import time
from types import SimpleNamespace
from typing import NamedTuple

import torch

from .cuda_graphs import DecodeGraphs, VerifyGraphs
from .kernels.sampling import draw_params, fused_draw, triton
from .kv_spec import KVSpec, kv_spec
from .model import CausalLM, KVCache, to_device  # noqa: F401  (to_device: imported from here too)
from .parallel import WorkerError
from .sampler import sample_batch, wants_filters
from .scheduler import SchedulerOutput

CPU_DEFAULT_KV_TOKENS = 32768  # on the CPU, max_kv_tokens sizes the cache (default 32768 tokens)


def kv_spec_of(config, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> KVSpec:
    """What one token's cache holds for a model in `dtype` (kv_spec.py, which takes the dtype's name and size)."""
    return kv_spec(kv_cache_dtype, config, str(dtype).replace("torch.", ""), dtype.itemsize)


def kv_bytes_per_token(config, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> int:
    """K and V of one token in every layer: 2 x layers x kv_heads x head_dim x bytes per element. int8: one byte
    per element, plus the fp32 scale of each (token, KV head) row: 2 x layers x kv_heads x (head_dim + 4).
    fp8: one byte per element and nothing per token (the scales are per layer)."""
    return kv_spec_of(config, dtype, kv_cache_dtype).bytes_per_token


def kv_pool_blocks(total_bytes: int, gpu_memory_utilization: float, used_bytes: int, bytes_per_block: int) -> int:
    """The KV cache's size in blocks: the share of the device we may use, minus what the weights and the peak of
    a warm-up forward took, in whole blocks (vLLM's gpu_memory_utilization, same meaning)."""
    return max(int(total_bytes * gpu_memory_utilization) - used_bytes, 0) // bytes_per_block


def results_numel(params: list) -> int:
    """The float64 values of a step's results (pack_results) for rows of these sampling params."""
    return 2 * len(params) + 2 * sum(sp.logprobs for sp in params if sp.logprobs is not None)


def pack_results(next_ids: list[int], chosen: list[float], tops: list, params: list) -> torch.Tensor:
    """The draw's lists -> one float64 tensor, as the last stage sends it to rank 0: every row's token, every row's
    logprob, then for each row that asked for logprobs=n its n best token ids and their logprobs (a token id is exact
    in a float64). Rank 0 knows the size from the plan (results_numel)."""
    values = [float(t) for t in next_ids] + list(chosen)
    for sp, top in zip(params, tops):
        if sp.logprobs is not None:
            values += [float(t) for t in top] + list(top.values())
    return torch.tensor(values, dtype=torch.float64)


def unpack_results(buffer: torch.Tensor, params: list) -> tuple[list[int], list[float], list]:
    """pack_results' tensor -> read_sampled's lists (the tops as {token: logprob}, in the draw's order)."""
    values, n = buffer.tolist(), len(params)
    next_ids, chosen, tops, at = [int(v) for v in values[:n]], values[n:2 * n], [], 2 * n
    for sp in params:
        if sp.logprobs is None:
            tops.append(None)
            continue
        k = sp.logprobs
        tops.append(dict(zip((int(v) for v in values[at:at + k]), values[at + k:at + 2 * k])))
        at += 2 * k
    return next_ids, chosen, tops


class Verdict(NamedTuple):
    """What one request's verify emits, in order: its accepted drafts, then one token of the target's."""

    tokens: list[int]
    logprobs: list[float]
    tops: list[dict[int, float] | None]  # its top-n logprobs per token (None: it asked for none)


class BlockTables:
    """Every running sequence's block table, kept from step to step in one row of a host tensor (vLLM V1's
    persistent block table), so that no step rebuilds the tables from the sequences' lists.

        rows     [max_rows, max_blocks] int32 on the host; nothing is copied to the device from it directly
                 (a step's rows are gathered first, into pinned memory on CUDA), so it needs no pinning
        lengths  [max_rows]: how many blocks each row holds; the entries past them are stale (the row's previous
                 sequence's) and never read: every kernel stops at its row's context length

    A sequence takes a free row the first time it is scheduled, and gives it back when its blocks go back to the
    pool (block_manager.release: finished, preempted or aborted). Each step, changes() lists for every scheduled
    sequence the blocks it got since its last step (none for a decode whose block has room; one when it crosses
    a block boundary; the whole table the first time), and write() puts them into the rows in place, one indexed
    copy for all of them. The step's rows are then read from here: gather() for the kernels' block tables,
    slots() for the slot mapping."""

    def __init__(self, max_rows: int, max_blocks: int, device: torch.device):
        self.max_rows, self.max_blocks, self.pinned = max_rows, max_blocks, device.type == "cuda"
        self.rows = torch.zeros(max_rows, max_blocks, dtype=torch.int32)
        self.lengths = [0] * max_rows
        self.row_of: dict[str, int] = {}  # request id -> its row, while the request holds blocks
        self.free_rows = list(range(max_rows - 1, -1, -1))  # pop() takes the lowest row first

    def changes(self, request_ids: list[str], block_tables: list[list[int]]) -> list[tuple[int, int, list[int]]]:
        """The step's rows (each request's id and block table, as the plan holds them) -> for each, (its row, how many
        blocks the row holds already, the blocks its table got since). A request seen for the first time takes a
        free row, and its whole table."""
        out = []
        for request_id, table in zip(request_ids, block_tables):
            row = self.row_of.get(request_id)
            if row is None:
                if not self.free_rows:  # more sequences hold blocks than the scheduler may run: a lost release
                    raise RuntimeError(f"no free block-table row: all {self.max_rows} are held")
                row = self.row_of[request_id] = self.free_rows.pop()
            start = self.lengths[row]
            if len(table) < start:  # its table was given back and begun again: a release not told here
                raise RuntimeError(f"request {request_id}: a block table of {len(table)} blocks in a row "
                                   f"holding {start} (the rows were not told of its release)")
            out.append((row, start, table[start:]))
        return out

    def write(self, changes) -> list[int]:
        """Write every row's new blocks into it, in place (one indexed copy for all of them). -> the rows, in the
        order of the work."""
        rows, columns, blocks = [], [], []
        for row, start, new in changes:
            if start + len(new) > self.max_blocks:
                raise ValueError(f"a block table of {start + len(new)} blocks is wider than the rows' "
                                 f"{self.max_blocks}")
            if new:
                rows += [row] * len(new)
                columns += range(start, start + len(new))
                blocks += new
            self.lengths[row] = start + len(new)
        if blocks:
            self.rows[torch.tensor(rows), torch.tensor(columns)] = torch.tensor(blocks, dtype=torch.int32)
        return [row for row, _, _ in changes]

    def release(self, request_id: str) -> None:
        """The request's blocks went back to the pool: its row (if it had one) is free for the next sequence."""
        row = self.row_of.pop(request_id, None)
        if row is not None:
            self.lengths[row] = 0
            self.free_rows.append(row)

    def trim(self, request_id: str, num_blocks: int) -> None:
        """The request's table was cut back to num_blocks (block_manager.trim, after rejected drafts): its row holds
        no more than that now, so the blocks it gets next are written from there."""
        row = self.row_of.get(request_id)
        if row is not None:
            self.lengths[row] = min(self.lengths[row], num_blocks)

    def table(self, row: int) -> list[int]:
        """The row's whole table, as a list (the torch backend's loop reads each context whole)."""
        return self.rows[row, :self.lengths[row]].tolist()

    def held(self) -> dict[int, list[int]]:
        """{row: the blocks it holds} for every row that holds any, as lists (to look at, not for a step's work)."""
        return {row: self.rows[row, :n].tolist() for row, n in enumerate(self.lengths) if n}

    def gather(self, rows: list[int], pinned: bool | None = None) -> torch.Tensor:
        """The step's rows, in its order, cut to the widest: int32 [S, widest], on the host; pinned (by default on
        CUDA) so that to_device queues its copy without a wait. One index_select, whatever the tables hold."""
        width = max(self.lengths[r] for r in rows)
        out = torch.empty(len(rows), width, dtype=torch.int32, pin_memory=self.pinned if pinned is None else pinned)
        return torch.index_select(self.rows[:, :width], 0, torch.tensor(rows), out=out)

    def slots(self, rows: list[int], positions: torch.Tensor, query_lens: list[int], block_size: int) -> torch.Tensor:
        """The flat cache slot of every new token at `positions` [N] (the rows' sequences one after another, each
        query_lens[i] tokens): block rows[row, p // block_size], offset p % block_size. -> int64 [N], on the host."""
        row_of_token = torch.repeat_interleave(torch.tensor(rows), torch.tensor(query_lens))  # [N]
        blocks = self.rows[row_of_token, positions // block_size].long()  # [N]
        return blocks * block_size + positions % block_size


class ModelRunner:
    def __init__(self, model: CausalLM, device: torch.device, dtype: torch.dtype, timers, stats: dict,
                 kv_cache_dtype: str = "auto", use_graphs: bool = False, max_num_seqs: int = 1, workers=None,
                 verify: tuple[int, int] | None = None):
        self.model, self.device, self.dtype = model, device, dtype
        self.kv_cache_dtype = kv_cache_dtype  # "auto" (the model's dtype) or "int8" (model.py's KVCache)
        self.kv_spec: KVSpec | None = None  # what one token's cache holds (kv_spec.py): set with the cache
        self.timers = timers  # the engine's phase timers: "prepare inputs", "forward" and "sample" are ours
        self.stats = stats  # the engine's counters: we count model forwards
        stats.setdefault("overlapped_launches", 0)  # launches made before the newest results were reached
        self.kv_cache: KVCache | None = None
        self.max_num_seqs = max_num_seqs  # the most sequences a step can hold: one block-table row each
        self.block_tables: BlockTables | None = None  # set with the cache (its width depends on the pool)
        self.use_graphs = use_graphs  # graphs: decided by the engine (CUDA only)
        self.graphs: DecodeGraphs | None = None  # set by capture_graphs
        self.verify_graphs: VerifyGraphs | None = None  # set by capture_graphs when speculation is on
        # (tokens per row: k + 1, the largest batch that drafts) of the verify graphs; None: no speculation
        self.verify_shape = None if verify is None else (verify[0], min(verify[1], max_num_seqs))
        self.scratch_block: int | None = None  # the cache block no sequence owns (padding rows write there)
        # the draw as one kernel (kernels/sampling.py) where the kernels run: CUDA, the triton backend's layer ops
        self.fused_sampler = (triton is not None and device.type == "cuda"
                              and getattr(getattr(model, "ops", None), "name", None) == "triton")
        self.draws = {"fused": 0, "torch": 0}  # sampling steps by path
        self.results_event = None  # the CUDA event behind the newest results' copies to the host (start_read_back)
        self.workers = workers  # rank 0 of a tensor-parallel group: parallel.py's Workers (None: alone, or a worker)
        self.host_store = None  # this rank's host blocks (offload.py), set by build_rank: a step's copies run here
        # [max_num_seqs] int64, the newest token sampled for each block-table row, written on the device
        self.last_token = torch.zeros(max_num_seqs, dtype=torch.int64, device=device)
        # tensor parallel: rank 0 broadcasts last_token to the workers after each step that samples, so
        # each rank fills its placeholders' input ids from its own copy (set by the engine; a worker is told per step)
        self.share_tokens = False

    # ---- the KV cache -------------------------------------------------------------------------------------
    def allocate_kv_cache(self, max_kv_tokens: int | None, block_size: int, warmup_tokens: int,
                          gpu_memory_utilization: float) -> dict:
        """Size the cache and allocate it; bind it to the model. Given max_kv_tokens (the CPU default, or a
        choice): that many tokens. Else (CUDA): profile one forward of the largest step (warmup_tokens prompt
        tokens), then give the cache what is left of gpu_memory_utilization x the device's memory after the
        weights and that forward's peak. -> what was decided (blocks, bytes per token, why)."""
        self.kv_spec = kv_spec_of(self.model.config, self.dtype, self.kv_cache_dtype)
        per_token = self.kv_spec.bytes_per_token
        memory = {"bytes_per_token": per_token, "block_size": block_size, "kv_cache_dtype": self.kv_cache_dtype,
                  "kv_dtype": self.kv_spec.dtype, "kv_spec": self.kv_spec}
        if max_kv_tokens is not None:
            memory.update(num_blocks=max_kv_tokens // block_size, sized_by="max_kv_tokens")
        else:
            used = self._profile_peak_bytes(warmup_tokens, block_size)
            if self.use_graphs:  # the graphs' memory pool is held for good: it is not the cache's
                memory["graph_pool_estimate_bytes"] = self._graph_pool_bytes(block_size)
                used += memory["graph_pool_estimate_bytes"]
            total = torch.cuda.get_device_properties(self.device).total_memory
            # one block fewer than fits: the scratch block
            num_blocks = max(kv_pool_blocks(total, gpu_memory_utilization, used, per_token * block_size) - 1, 0)
            num_blocks = self.model.tp.agree_min(num_blocks)  # tensor parallel: every rank holds the same blocks
            if num_blocks * block_size < warmup_tokens:
                share = total * gpu_memory_utilization / 2**30
                raise ValueError(f"gpu_memory_utilization={gpu_memory_utilization}: {share:.2f} GiB of the device's "
                                 f"{total / 2**30:.2f} GiB, minus {used / 2**30:.2f} GiB for weights and a warm-up "
                                 f"forward, leaves room for {num_blocks * block_size} KV tokens, fewer than one "
                                 f"step's {warmup_tokens}; raise gpu_memory_utilization or lower "
                                 "max_num_batched_tokens")
            memory.update(num_blocks=num_blocks, sized_by=f"gpu_memory_utilization={gpu_memory_utilization}",
                          total_bytes=total, used_bytes=used, utilization=gpu_memory_utilization)
        # One block past the block manager's: the scratch block, where a padded graph row's K/V go.
        self.scratch_block = memory["num_blocks"]
        memory["scratch_blocks"] = 1
        self.kv_cache = self.model.kv_cache = KVCache(self.model.config, memory["num_blocks"] + 1, block_size,
                                                      self.device, self.kv_spec)
        self.block_tables = BlockTables(self.max_num_seqs, self.max_table_blocks(block_size), self.device)
        return memory

    def release(self) -> None:
        """Let go of the KV cache, the CUDA graphs (their private memory pool goes with them) and the block-table
        rows now, and hand the freed memory back to the device, so that a new engine in this process can have it
        at once rather than when the garbage collector finds this one. The runner runs no step after this."""
        self.graphs = self.verify_graphs = None
        if self.host_store is not None:  # its queued copies finish first
            self.host_store.release()
        self.kv_cache = self.model.kv_cache = None
        self.block_tables = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # nothing in flight still reads what goes back
            torch.cuda.empty_cache()

    def max_table_blocks(self, block_size: int) -> int:
        """The widest block table a sequence can have: its longest length in blocks, at most the whole cache."""
        return min(-(-self.model.config.max_position_embeddings // block_size), self.kv_cache.data.shape[2])

    def capture_graphs(self, block_size: int) -> dict:
        """Record the decode forward once per bucket (cuda_graphs.py), on the allocated cache. With
        speculation (self.verify_shape), the verify forward's graphs too, in the same pool. -> what was done."""
        import time

        start = time.perf_counter()
        self.graphs = DecodeGraphs(self.model, self.device, self.max_num_seqs, block_size, self.scratch_block,
                                   self.max_table_blocks(block_size), self.model.config.max_position_embeddings)
        self.graphs.capture()
        done = {"sizes": self.graphs.sizes, "pool_bytes": self.graphs.pool_bytes}
        if self.verify_shape is not None:
            query_len, max_seqs = self.verify_shape
            self.verify_graphs = VerifyGraphs(self.model, self.device, max_seqs, query_len,
                                              block_size, self.scratch_block, self.max_table_blocks(block_size),
                                              pool=self.graphs.pool)
            self.verify_graphs.capture()
            done.update(verify_sizes=self.verify_graphs.sizes, verify_query_len=query_len)
            done["pool_bytes"] += self.verify_graphs.pool_bytes
        done["seconds"] = time.perf_counter() - start
        return done

    def _graph_pool_bytes(self, block_size: int) -> int:
        """The memory the graphs will hold, measured: the largest bucket's graph captured on a cache of one block
        (its rows all padding), then thrown away. The smaller graphs share its pool."""
        self.model.kv_cache = KVCache(self.model.config, 1, block_size, self.device, self.kv_spec)
        probe = DecodeGraphs(self.model, self.device, self.max_num_seqs, block_size, 0, 1,
                             self.model.config.max_position_embeddings, sizes=[self.max_num_seqs])
        probe.capture()
        pool = probe.pool_bytes
        if self.verify_shape is not None:  # the verify graphs' largest, in the same pool
            query_len, max_seqs = self.verify_shape
            verify = VerifyGraphs(self.model, self.device, max_seqs, query_len, block_size, 0,
                                  -(-query_len // block_size), pool=probe.pool)
            verify.sizes = verify.sizes[-1:]
            verify.capture()
            pool += verify.pool_bytes
            del verify
        del probe
        self.model.kv_cache = None
        torch.cuda.empty_cache()
        return pool

    def _profile_peak_bytes(self, num_tokens: int, block_size: int) -> int:
        """Run one forward of num_tokens prompt tokens through a scratch cache; return the peak bytes allocated
        (weights + the largest activations), without the scratch cache itself (the real cache replaces it)."""
        num_blocks = -(-num_tokens // block_size)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self.model.kv_cache = KVCache(self.model.config, num_blocks, block_size, self.device, self.kv_spec)
        # One prompt of num_tokens tokens, as the attention backend reads a sequence: its metadata is built by the
        # backend that will run (the kernels' on the triton path), through the same prepare as every step.
        prompt = SchedulerOutput.of(["profile"], [0], [num_tokens], [num_tokens], [[0] * num_tokens], [],
                                    block_tables=[list(range(num_blocks))])
        self.block_tables = BlockTables(1, num_blocks, self.device)  # its one row, for this forward only
        self.model.forward(*self.prepare(prompt, block_size))
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        self.model.kv_cache = self.block_tables = None
        torch.cuda.empty_cache()
        return peak - num_blocks * block_size * self.kv_spec.bytes_per_token

    # ---- one engine step ----------------------------------------------------------------------------------
    def prepare(self, plan: SchedulerOutput, block_size: int | None = None, changes=None):
        """The step's plan, every row's new tokens -> one flat batch: input ids and positions [N], and the attention
        metadata (built by the model's attention backend, attention.py). A decode is a row with one new token; a
        prefill chunk has n. changes: the rows' block-table changes (None: found here). A row among the plan's
        placeholders has its last input id filled on the device."""
        block_size = block_size or self.kv_cache.data.shape[3]
        tables = self.block_tables
        rows = tables.write(self.changes(plan) if changes is None else changes)  # each row: its whole table
        late = set(plan.placeholders)
        ids, positions, fill = [], [], []
        for i, (known, start, n, row) in enumerate(zip(plan.token_ids, plan.starts, plan.query_lens, rows)):
            ids += known
            if i in late:  # its last input is not known to the host: 0 here, then last_token's, on the device
                fill.append((len(ids), row))
                ids.append(0)
            positions += range(start, start + n)
        positions = torch.tensor(positions)  # [N]
        slots = tables.slots(rows, positions, plan.query_lens, block_size)  # [N]: where the K/V write goes
        metadata = self.model.attention_backend.metadata(plan, to_device(slots, self.device), block_size, tables, rows)
        input_ids = to_device(torch.tensor(ids), self.device)
        if fill:
            self.fill_placeholders(input_ids, fill)
        return input_ids, to_device(positions, self.device), metadata

    def fill_placeholders(self, input_ids: torch.Tensor, fill: list[tuple[int, int]]) -> None:
        """The input ids the host does not know yet, each a (flat index into input_ids, its sequence's
        block-table row): input_ids[index] = last_token[row], on the device, queued behind the step before's sampling
        (which wrote last_token). One small copy to the device (pinned, no wait), one gather and one scatter."""
        index = to_device(torch.tensor(fill).T.contiguous(), self.device)  # [2, P]: flat indices, rows
        input_ids[index[0]] = self.last_token[index[1]]

    def changes(self, plan: SchedulerOutput) -> list[tuple[int, int, list[int]]]:
        """The plan's rows' block-table changes (BlockTables.changes), decided by rank 0 (or a runner alone)."""
        return self.block_tables.changes(plan.request_ids, plan.block_tables)

    def graph_can_run(self, plan: SchedulerOutput) -> bool:
        """A step of decodes only (each row its request's newest token), no larger than the largest graph."""
        return self.graphs is not None and plan.num_rows <= self.graphs.sizes[-1] and plan.decodes_only

    def execute(self, plan: SchedulerOutput, changes=None, logits_rows: list[int] | None = None,
                keep_on_device: bool = False) -> torch.Tensor:
        """Run the step's plan in one forward: every (sequence, new tokens) side by side in one flat batch.
        A step of decodes replays its bucket's graph; any other step runs eagerly.
        -> the logits of each sequence's last new token, in the order of the rows: [S, vocab].
        The plan's placeholders: the rows whose last new token is a placeholder (sampled by the step before, not
        read by the host): its input id is its row's last_token, on the device.
        logits_rows (flat token indices) -> the logits of those tokens instead; such a step runs eagerly,
        on one rank (the engine refuses speculation with tensor parallelism). The plan's copies: the host tier's
        (offload.py), run by every rank on its own blocks before the forward.
        Tensor parallel: rank 0 first sends the rows to the workers, with their block-table changes (each sequence's
        row and the blocks it got since its last step), and the workers run this same method on them."""
        if self.results_event is not None and not self.results_event.query():  # the device still runs a step
            self.stats["overlapped_launches"] += 1  # whose results the host has not read: this one overlaps
        if changes is None:  # rank 0 (or alone) decides the rows; a worker is given them
            with self.timers.phase("prepare inputs"):
                changes = self.changes(plan)
        if plan.copies:  # the host tier's copies, ordered before this forward
            with self.timers.phase("prepare inputs"):
                self.host_store.run(plan.copies)
        if self.workers is None:
            return self._execute(plan, changes, logits_rows)
        # the workers wait for rank 0's tokens only after a step that keeps them on the device (launch_sample)
        share_tokens = self.share_tokens and keep_on_device and bool(plan.sample_rows)
        self.workers.start_step(self.model.tp, plan, changes, share_tokens=share_tokens)
        try:
            return self._execute(plan, changes)
        except BaseException as e:
            failure = None if isinstance(e, KeyboardInterrupt) else self.workers.failure(wait_s=1)
            if failure:  # a collective failed because a worker died or failed: say which
                self.workers.stop_steps(failure)
                raise WorkerError(failure) from e
            # the workers may be inside this step's collectives, waiting for rank 0's
            self.workers.stop_steps(f"a step stopped on rank 0 inside its forward ({type(e).__name__}: {e}), so the "
                                    "ranks' collectives no longer line up")
            raise

    def _execute(self, plan: SchedulerOutput, changes, logits_rows=None) -> torch.Tensor:
        placeholders, num_rows = plan.placeholders, plan.num_rows
        if logits_rows is not None and self.verify_graphs is not None and self.verify_graphs.can_run(plan):
            return self._replay_verify(plan, changes, logits_rows)
        if logits_rows is None and self.graph_can_run(plan):
            with self.timers.phase("prepare inputs"):
                rows = self.block_tables.write(changes)  # the new blocks, in place
                size = self.graphs.prepare(plan, self.block_tables, rows)
                if placeholders:  # row i of the static inputs is the plan's row i
                    self.fill_placeholders(self.graphs.inputs.input_ids, [(i, rows[i]) for i in placeholders])
            with self.timers.phase("forward"):
                self.stats["forwards"] += 1
                self.stats["graph_replays" if size in self.graphs.graphs else "eager_forwards"] += 1
                self.stats["padded_rows"] += size - num_rows
                return self.graphs.launch(size, num_rows)
        with self.timers.phase("prepare inputs"):
            input_ids, positions, attn = self.prepare(plan, changes=changes)
        pipe = self.model.pipe
        with self.timers.phase("forward"):
            self.stats["forwards"] += 1
            self.stats["eager_forwards"] += 1
            if pipe.size == 1:
                return self.model.forward(input_ids, positions, attn, logits_rows)
            # a later stage starts from the stream the stage before sent (its wait is idle time, not the forward's)
            hidden = None if pipe.is_first else pipe.recv_hidden(len(positions), self.model.config.hidden_size,
                                                                 self.dtype, self.device)
            start = time.perf_counter()
            out = self.model.forward(input_ids, positions, attn, hidden=hidden)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # the stage's work done: its end is the timeline's
            pipe.timeline.append((start, time.perf_counter()))
            if not pipe.is_last:
                pipe.send_hidden(out)  # on to the next stage, asynchronously
            return out

    def _replay_verify(self, plan: SchedulerOutput, changes, logits_rows: list[int]) -> torch.Tensor:
        """A verify step (drafting rows and decodes, no prompt chunk) in its bucket's graph: every row padded
        to k + 1 tokens (cuda_graphs.py's VerifyGraphs); -> the logits of logits_rows, picked from the graph's."""
        graphs = self.verify_graphs
        with self.timers.phase("prepare inputs"):
            rows = self.block_tables.write(changes)
            size = graphs.prepare(plan, self.block_tables, rows)
            picked = to_device(torch.tensor(graphs.graph_rows(plan.query_lens, logits_rows)), self.device)
        with self.timers.phase("forward"):
            self.stats["forwards"] += 1
            self.stats["graph_replays" if size in graphs.graphs else "eager_forwards"] += 1
            self.stats["verify_replays"] += size in graphs.graphs
            self.stats["padded_rows"] += size - plan.num_rows
            return graphs.launch(size, size * graphs.query_len)[picked]

    def execute_stage(self, plan: SchedulerOutput, changes) -> None:
        """A worker's step (worker.py's serve_steps): its forward of rank 0's plan (execute: with several stages, the
        stream received from the stage before and sent to the next); on the rank that samples (the last stage's tp
        rank 0, when it is not rank 0), the draw of the rows that sample, sent back to rank 0 (pack_results)."""
        logits = self.execute(plan, changes)
        pipe = self.model.pipe
        if pipe.size == 1 or not pipe.samples or not plan.sample_rows:
            return
        with self.timers.phase("sample"):
            if len(plan.sample_rows) < len(logits):
                logits = logits[to_device(torch.tensor(plan.sample_rows), logits.device)]
        sampling = [plan.sampling[i] for i in plan.sample_rows]
        next_ids, chosen, tops = self.read_sampled(self.launch_sample(sampling, logits))
        pipe.send_results(pack_results(next_ids, chosen, tops, [sp for sp, _, _ in sampling]))

    def execute_model(self, plan: SchedulerOutput, keep_on_device: bool = False):
        """One step on the device: the forward of every row of the plan (execute), then one sampler call for the
        rows that sample (the plan's sample_rows: a decode, or a chunk that reaches its prompt's end), queued
        (launch_sample), and the verdict on the drafts (the plan's {row: drafts}; verify, one wait). A drafting
        sequence's logits are taken at its newest token and at every draft, one row else (logits_rows). -> (the draw
        on its way to the host, which read_sampled reads, or None when no row samples; the verdicts in the order of
        the drafting rows, or None). The logits stay in the runner."""
        sample_rows, drafts = plan.sample_rows, plan.drafts
        logits_rows, first_row = None, list(range(plan.num_rows))  # the logits' first row of each
        if drafts:
            logits_rows, first_row, start = [], [], 0
            for i, n in enumerate(plan.query_lens):
                first_row.append(len(logits_rows))
                logits_rows += range(start, start + n) if i in drafts else [start + n - 1]
                start += n
        logits = self.execute(plan, logits_rows=logits_rows, keep_on_device=keep_on_device)  # in the rows' order
        launched = verdicts = None
        if self.model.pipe.size > 1:  # rank 0 ran stage 0: the tokens come back from the last stage, later
            if not sample_rows:
                return None, None
            params = [plan.sampling[i][0] for i in sample_rows]
            work, buffer = self.model.pipe.expect_results(results_numel(params))
            return SimpleNamespace(pipeline=(work, buffer), params=params, num=len(params)), None
        if sample_rows:
            with self.timers.phase("sample"):
                plain = logits
                if len(sample_rows) < len(logits):  # the index goes to the device without a wait (pinned)
                    plain = logits[to_device(torch.tensor([first_row[i] for i in sample_rows]), logits.device)]
            launched = self.launch_sample([plan.sampling[i] for i in sample_rows], plain,
                                          [plan.request_ids[i] for i in sample_rows] if keep_on_device else None)
        if drafts:
            index = sorted(drafts)
            places = [first_row[i] + j for i in index for j in range(len(drafts[i]) + 1)]  # their rows of logits
            verdicts = self.verify(logits, places, [plan.sampling[i] for i in index], [drafts[i] for i in index])
        return launched, verdicts

    def sample(self, sampling: list[tuple], logits: torch.Tensor) -> tuple[list[int], list[float], list]:
        """One sampler call for the batch: each row's (sampling params, seed, output index of its next token) as the
        plan's sampling holds them, and logits [B, vocab] -> (next token ids, their logprobs, and for each row that
        asked for logprobs its top ones as {token: logprob}, else None). Everything is computed on the device; read_back
        brings it to the host in the step's one wait. When no row asks for a filter and the kernels run (CUDA, the
        triton backend), the draw and the chosen tokens' logprobs are one kernel (kernels/sampling.py; greedy-only steps
        too); else sampler.py's operators. In two halves: launch_sample, then read_sampled."""
        return self.read_sampled(self.launch_sample(sampling, logits))

    def launch_sample(self, sampling: list[tuple], logits: torch.Tensor, kept_for: list[str] | None = None):
        """The first half of sample(): the sampling queued on the device and the copies of its results to the host
        queued behind it, with no wait. kept_for: the rows' request ids, when each sampled token is also written
        into last_token at its request's block-table row, for the next step's placeholders (None: not kept).
        -> what read_sampled reads."""
        params, seeds, positions = (list(column) for column in zip(*sampling))  # positions: those in flight too
        return self.launch_draw(logits, params, seeds, positions,
                                last_token_rows=None if kept_for is None else
                                [self.block_tables.row_of[request_id] for request_id in kept_for])

    def launch_draw(self, logits: torch.Tensor, params: list, seeds: list[int], positions: list[int],
                    last_token_rows: list[int] | None = None) -> SimpleNamespace:
        """One draw per row of logits [R, vocab], each keyed by its (seed, position), queued with its copies
        to the host: a plain step's rows (one per request) and a verify step's (one per place of a request's drafts)
        go through this same draw, so a place gets the same token in either. last_token_rows: the block-table rows
        whose last_token the drawn tokens become (None: not kept on the device)."""
        with self.timers.phase("sample"):
            token_logprobs = None
            # a greedy-only step takes the kernel too (its first maximum is argmax's token): torch's
            # log_softmax for its logprobs is one program per row, 34 us of a 0.8 ms token at batch 1 on the H200
            if self.fused_sampler and not wants_filters(params, logits.shape[-1]):
                self.draws["fused"] += 1
                keys = draw_params([sp.temperature for sp in params], seeds, positions)
                next_ids, chosen = fused_draw(logits, to_device(keys, logits.device))  # [R], [R], on the device
            else:
                self.draws["torch"] += 1
                token_logprobs = torch.log_softmax(logits, dim=-1)  # [R, vocab]
                next_ids = sample_batch(logits, params, seeds, positions)  # [R], on the device
                chosen = token_logprobs.gather(1, next_ids[:, None])[:, 0]  # [R]
            # Rows that asked for logprobs=n: the n most likely of their rows, one topk per distinct n.
            asked: dict[int, list[int]] = {}
            for i, sp in enumerate(params):
                if sp.logprobs is not None:
                    asked.setdefault(sp.logprobs, []).append(i)
            tops = []
            for n, rows in asked.items():
                index = to_device(torch.tensor(rows), logits.device)
                picked = token_logprobs[index] if token_logprobs is not None else torch.log_softmax(logits[index], -1)
                values, ids = picked.topk(n, dim=-1) if n > 0 else (picked[:, :0], picked[:, :0].long())
                tops += [values, ids]
            if last_token_rows is not None:  # the next step's inputs read them from here, on the device
                self.last_token.index_copy_(0, to_device(torch.tensor(last_token_rows), logits.device), next_ids)
                if self.share_tokens:  # the workers' copies (they wait for it: execute told them it comes)
                    self.model.tp.broadcast_tokens(self.last_token)
            return SimpleNamespace(copies=self.start_read_back(next_ids, chosen, *tops), asked=asked,
                                   num=len(params))

    def verify(self, logits: torch.Tensor, places: list[int], sampling: list[tuple],
               drafts: list[list[int]]) -> list[Verdict]:
        """The target's verdict on every request's drafts. places: the rows of logits [rows, vocab] that are
        the requests' k_i + 1 places, request by request (the place before draft j predicts draft j; the last one
        predicts the token after the last draft).
        Every row is drawn as a plain step draws at that place (launch_draw: the argmax, or the draw keyed by the
        request's seed and the token's position), read back with one wait; per request the drafts pass while they
        equal their row's token, and the first row whose token differs, or the last row, adds its own token.
        -> one Verdict per request: the tokens to emit, their logprobs (raw log-softmax, as a plain step reports
        them) and their top-n logprobs."""
        params, seeds, positions = [], [], []
        for (sp, seed, first), ds in zip(sampling, drafts):  # first: the output index of its first draft
            for j in range(len(ds) + 1):
                params.append(sp)
                seeds.append(seed)
                positions.append(first + j)
        if len(places) < len(logits):  # the index goes to the device without a wait (pinned)
            logits = logits[to_device(torch.tensor(places), logits.device)]  # [T, vocab]
        tokens, logprobs, tops = self.read_sampled(self.launch_draw(logits, params, seeds, positions))
        verdicts, row = [], 0
        for ds in drafts:
            end = row + len(ds)  # the last row: the bonus token's
            while row < end and tokens[row] == ds[row - (end - len(ds))]:
                row += 1
            emitted = slice(end - len(ds), row + 1)  # the accepted drafts (their own rows' tokens) and one more
            verdicts.append(Verdict(tokens[emitted], logprobs[emitted], tops[emitted]))
            row = end + 1
        return verdicts

    def read_sampled(self, launched: SimpleNamespace) -> tuple[list[int], list[float], list]:
        """The second half of sample(): wait for launch_sample's copies, -> sample's lists. A step of several
        stages: wait for the last stage's results (the receive execute_model posted)."""
        if getattr(launched, "pipeline", None) is not None:
            with self.timers.phase("sample"):
                work, buffer = launched.pipeline
                try:
                    work.wait()
                except Exception as e:  # a stage died or failed: the engine cannot run on
                    failure = self.workers.failure(wait_s=1) if self.workers is not None else None
                    reason = failure or WorkerError(f"the last pipeline stage's tokens did not come: {e}")
                    if self.workers is not None:
                        self.workers.stop_steps(reason)
                    raise reason from e
                return unpack_results(buffer, launched.params)
        with self.timers.phase("sample"):
            next_list, chosen_list, *top_lists = self.read_back(launched.copies)
            asked, top = launched.asked, [None] * launched.num
            for k, rows in enumerate(asked.values()):
                for row, values, ids in zip(rows, top_lists[2 * k], top_lists[2 * k + 1]):
                    top[row] = dict(zip(ids, values))
        return next_list, chosen_list, top

    def start_read_back(self, *tensors: torch.Tensor) -> SimpleNamespace:
        """The first half of read_back(): each tensor's copy into pinned host memory queued (no wait), and an event
        recorded behind them. On a CPU the tensors are the results already: no copy, no event."""
        if self.device.type != "cuda":
            return SimpleNamespace(hosts=tensors, event=None)
        hosts = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
        for host, t in zip(hosts, tensors):
            host.copy_(t, non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        self.results_event = event  # the newest results' event: execute counts the launches made before it is reached
        return SimpleNamespace(hosts=hosts, event=event)

    def read_back(self, copies: SimpleNamespace) -> list[list]:
        """Device tensors -> Python lists, with one wait for the GPU: the host waits once, for the event behind
        start_read_back's copies. In two halves, so that other work can go between them."""
        if copies.event is not None:
            copies.event.synchronize()
            self.stats["syncs"] += 1
        return [h.tolist() for h in copies.hosts]
