"""A rank: how one is built, and the worker processes that hold ranks 1..N-1 (parallel.py says how the model is cut).

build_rank is the whole of a rank's set-up, from the engine's config (config.py): its share of the model, the
attention backend, the KV cache and the CUDA graphs. Rank 0 (the engine, in the user's process) and every worker run
this same build, so the collectives inside it (the profiled forward that sizes the cache, the captures) meet.

Rank 0 starts the workers with the spawn method, each given the config (start_tensor_parallel), and keeps a handle
on them (Workers): a pipe per worker for its doorbell and its words (hello, ready, error, its block-table rows), and
the process to watch. A worker's life is worker_main: join the group, build, say ready, then run every step rank 0
announces, until told to stop or orphaned (the pipe closes with rank 0's process).

Layers: engine.py imports this module; this module imports the engine's config (config.py), the model, the runner,
the attention backends and parallel.py; none of those imports it back.
"""
from __future__ import annotations

import os
import time
import traceback

import torch

from .attention import BACKENDS
from .config import EngineConfig
from .model import CausalLM
from .model_runner import ModelRunner
from .offload import HostKVStore
from .parallel import TIMEOUT_S, TensorParallel, WorkerError, WorkerValueError, free_port, rank_device  # noqa: F401
from .scheduler import SchedulerOutput
from .timers import PhaseTimers

COPY_KINDS = ("out", "in")  # a host-tier copy's kind, as pack_plan numbers it


def pack_plan(plan, changes) -> torch.Tensor:
    """The step's plan (scheduler.py's SchedulerOutput) and its block-table changes (BlockTables.changes: each row's
    table row, how many blocks the row holds, the blocks new since) -> one int64 tensor: S, then per row (start, n,
    end, table row, blocks held, new blocks, placeholder), then every row's known new token ids, then every row's
    new blocks, then the host tier's copies (offload.py: how many, then kind, from, to of each). A worker needs no
    more: no request ids (the table rows name the rows), no sampling (rank 0 samples). end: whether the row reaches
    its request's newest token (a decode, a prompt's last chunk)."""
    late, ends = set(plan.placeholders), set(plan.sample_rows)
    head, ids, blocks = [plan.num_rows], [], []
    for i, (start, n, known, (row, held, new)) in enumerate(zip(plan.starts, plan.query_lens, plan.token_ids,
                                                                 changes)):
        head += [start, n, int(i in ends), row, held, len(new), int(i in late)]
        ids += known
        blocks += new
    tail = [len(plan.copies)] + [v for kind, a, b in plan.copies for v in (COPY_KINDS.index(kind), a, b)]
    return torch.tensor(head + ids + blocks + tail, dtype=torch.int64)


def unpack_plan(packed: torch.Tensor) -> tuple[SchedulerOutput, list]:
    """pack_plan's tensor -> (the plan, with no block tables and no sampling; its block-table changes): the step as
    rank 0 scheduled it. Each row's request is named by its table row."""
    values = packed.tolist()
    num = values[0]
    heads = [values[1 + 7 * i:8 + 7 * i] for i in range(num)]
    id_at = 1 + 7 * num
    block_at = id_at + sum(head[1] - head[6] for head in heads)
    token_ids, changes = [], []
    for start, n, end, row, held, num_new, placeholder in heads:
        token_ids.append(values[id_at:id_at + n - placeholder])
        changes.append((row, held, values[block_at:block_at + num_new]))
        id_at, block_at = id_at + n - placeholder, block_at + num_new
    copies = [(COPY_KINDS[k], a, b) for k, a, b in zip(*[iter(values[block_at + 1:])] * 3)]
    columns = list(zip(*heads)) if heads else [()] * 7
    placeholders = [i for i, head in enumerate(heads) if head[6]]
    plan = SchedulerOutput.of([f"row {row}" for row in columns[3]], columns[0], columns[1],
                              [bool(end) for end in columns[2]], token_ids, placeholders, copies=copies)
    return plan, changes


def graphs_off_reason(enforce_eager: bool, device: torch.device, attention_backend: str) -> str | None:
    """Why this engine runs without CUDA graphs, or None when it captures them."""
    if enforce_eager:
        return "enforce_eager=True"
    if device.type != "cuda":
        return f"the device is {device.type}: CUDA graphs need a CUDA GPU"
    if attention_backend != "triton":
        return "attention_backend='torch' builds each step's metadata on the host, so it cannot be replayed"
    return None


def new_stats() -> dict:
    """The engine's counters. rows: summed. graph_replays (forwards replayed from a graph), eager_forwards,
    padded_rows (rows added to fill a bucket), syncs (waits for the GPU: one per step that samples, on CUDA).
    verify_replays (verify steps replayed from a graph)."""
    return {"prefill_chunks": 0, "decode_steps": 0, "decode_rows": 0, "forwards": 0, "graph_replays": 0,
            "eager_forwards": 0, "padded_rows": 0, "syncs": 0, "verify_replays": 0}


def build_rank(config: EngineConfig, device: torch.device, tp: TensorParallel):
    """One rank's model runner, as the engine's config says: its share of the model, the attention backend, the KV
    cache (sized, on CUDA, by a profiled forward) and the CUDA graphs. Rank 0 (the engine) and every worker run this
    same build, on its own device, so the collectives in its forwards meet. The verify steps' graphs too
    (config.verify_graphs: k + 1 tokens per row, up to the largest batch that drafts). -> (runner, memory,
    cuda_graphs)."""
    c = config
    model = CausalLM.from_pretrained(c.model_dir, device, c.dtype, tp, c.gguf_file, c.quantization,
                                     c.enable_expert_parallel)
    # One object decides how attention runs: its metadata every step (the runner), its attention every layer
    # (the model). attention.py: TorchAttention (step14_7's loop) or TritonAttention (the kernels).
    model.attention_backend = BACKENDS[c.attention_backend](model.config, device)
    if c.attention_backend == "triton":  # the kernels' path: the layer's elementwise groups fused (kernels/fused.py)
        from .kernels.fused import TritonLayerOps
        model.ops = TritonLayerOps()
    off = graphs_off_reason(c.enforce_eager, device, c.attention_backend)
    runner = ModelRunner(model, device, c.dtype, PhaseTimers(device), new_stats(), c.kv_cache_dtype,
                         use_graphs=off is None, max_num_seqs=c.max_num_seqs, verify=c.verify_graphs)
    warmup_tokens = min(c.max_num_batched_tokens, c.max_model_len)  # the largest step: its forward is profiled
    memory = runner.allocate_kv_cache(c.max_kv_tokens, c.block_size, warmup_tokens, c.gpu_memory_utilization)
    # CUDA graphs: captured now, on the allocated cache (the graphs record its addresses)
    graphs = {"enabled": off is None, "reason": off}
    if off is None:
        graphs.update(runner.capture_graphs(c.block_size))
        memory["graph_pool_bytes"] = graphs["pool_bytes"]
    if c.kv_offloading_size:  # this rank's host blocks; the tier's decisions are rank 0's (core.py)
        runner.host_store = HostKVStore.sized(runner.kv_cache, c.kv_offloading_size, device, runner.stats, tp)
        memory.update(host_blocks=runner.host_store.num_slots, host_bytes=runner.host_store.nbytes * tp.size)
    return runner, memory, graphs


def start_tensor_parallel(config: EngineConfig, device: torch.device):
    """Start the N - 1 workers (N: config.tensor_parallel_size) and join the group as rank 0, on `device`.
    -> (Workers, rank 0's TensorParallel)."""
    import torch.distributed as dist

    if dist.is_initialized():
        raise RuntimeError("a tensor-parallel engine is already running in this process: shutdown() it first "
                           "(torch.distributed holds one group per process)")
    workers = Workers(config, device)
    try:
        workers.wait_started()
        tp = TensorParallel.connect(0, workers.size, workers.init_method, rank_device(device, 0), workers.timeout_s)
    except BaseException:
        workers.shutdown()
        raise
    return workers, tp


def stop_tensor_parallel(workers: Workers, tp: TensorParallel) -> None:
    workers.shutdown()
    tp.close()


# ---- the worker processes ----------------------------------------------------------------------------------------
class Workers:
    """Rank 0's handle on ranks 1..N-1: starts them, rings their doorbells, stops them. Holds no reference to the
    engine, so the engine's finaliser can stop them when the engine goes away."""

    def __init__(self, config: EngineConfig, device: torch.device, timeout_s: float = TIMEOUT_S):
        import multiprocessing as mp

        self.size, self.timeout_s = config.tensor_parallel_size, timeout_s
        self.init_method = f"tcp://127.0.0.1:{free_port()}"
        self.failed: str | None = None
        self.processes, self.conns = [], []
        ctx = mp.get_context("spawn")
        for rank in range(1, self.size):
            parent_end, child_end = ctx.Pipe()
            p = ctx.Process(target=worker_main, name=f"tp-worker-{rank}", daemon=True,
                            args=(rank, self.size, self.init_method, str(device), config, child_end, timeout_s))
            p.start()
            child_end.close()
            self.processes.append(p)
            self.conns.append(parent_end)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    def wait_started(self) -> None:
        """Every worker has started (its imports done) and is joining the group: wait for each one's word."""
        self._wait_all("hello")

    def wait_ready(self) -> None:
        """Every worker has loaded its shard and built its cache (and graphs): wait for each one's word."""
        self._wait_all("ready")

    def _wait_all(self, word: str) -> None:
        for rank, (p, conn) in enumerate(zip(self.processes, self.conns), start=1):
            self._expect(rank, p, conn, word)

    def _expect(self, rank: int, p, conn, word: str):
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            if conn.poll(0.1):
                try:
                    kind, detail = conn.recv()
                except EOFError:
                    break
                if kind == word:
                    return detail
                self._fail(self._error(rank, p, detail))
            if not p.is_alive():
                break
        self.check_alive()
        self._fail(f"tensor-parallel worker {rank} (pid {p.pid}) did not get {word} within {self.timeout_s:.0f} s")

    def _fail(self, error: WorkerError | str):
        error = error if isinstance(error, WorkerError) else WorkerError(error)
        self.failed = self.failed or str(error)
        raise error

    @staticmethod
    def _error(rank: int, p, detail) -> WorkerError:
        """What a worker reported, ("error", (its traceback, whether it was a ValueError)), as the error rank 0 raises,
        naming the worker: a ValueError stays one (WorkerValueError: a bad option or a checkpoint that does not fit
        that rank's share is the caller's ValueError, as it is on one rank), anything else is a WorkerError."""
        text, value_error = detail if isinstance(detail, tuple) else (detail, False)
        return (WorkerValueError if value_error else WorkerError)(
            f"tensor-parallel worker {rank} (pid {p.pid}) failed:\n{text}")

    def stop_steps(self, reason: WorkerError | str) -> None:
        """No step may run any more (the ranks are out of step): every later step raises WorkerError(reason)."""
        self.failed = self.failed or str(reason)

    def failure(self, wait_s: float) -> WorkerError | None:
        """What a worker reported or how it ended, waiting up to wait_s for it, as the error to raise (_error): after
        rank 0's own build failed (a worker's error usually comes first, and rank 0's collective only saw the
        connection close). None: none."""
        deadline = time.monotonic() + wait_s
        while True:
            for rank, (p, conn) in enumerate(zip(self.processes, self.conns), start=1):
                try:
                    if conn.poll(0):
                        kind, detail = conn.recv()
                        if kind == "error":
                            return self._error(rank, p, detail)
                except (EOFError, OSError):
                    pass
                if not p.is_alive():
                    return WorkerError(f"tensor-parallel worker {rank} (pid {p.pid}) died with exit code {p.exitcode}")
            if time.monotonic() > deadline:
                return None
            time.sleep(0.1)

    def check_alive(self) -> None:
        """Raise WorkerError if a worker is gone or failed (or did before): checked before every step."""
        if self.failed:
            raise WorkerError(self.failed + " (the engine stopped: shutdown() it and make a new LLM)")
        failure = self.failure(wait_s=0)
        if failure:
            self._fail(failure)

    def start_step(self, tp: TensorParallel, plan: SchedulerOutput, changes, share_tokens: bool = False) -> None:
        """Ring every doorbell (the size of the step's inputs), then broadcast the inputs (the plan, with its
        block-table changes and the host tier's copies: pack_plan): the workers run the same copies and forward as
        rank 0 from here. share_tokens: the doorbell says "step+tokens": after the forward each worker also receives
        rank 0's last_token."""
        self.check_alive()
        packed = pack_plan(plan, changes)
        try:
            for conn in self.conns:
                conn.send(("step+tokens" if share_tokens else "step", packed.numel()))
            tp.broadcast_inputs(packed, packed.numel())
        except Exception as e:  # a pipe or a socket closed under us: a worker went away mid-step
            # its end may show a moment after its socket closed (a killed process is reaped after the reset)
            self._fail(self.failure(wait_s=1) or f"tensor-parallel step failed: {e}")

    def block_tables(self) -> list[dict[int, list[int]]]:
        """Each worker's block-table rows as it holds them now, {row: its blocks} (BlockTables.held), asked between
        steps: what a test compares with rank 0's own rows. A worker hears of no release: a row rank 0 has freed
        keeps its last table there until rank 0 hands the row out again, whole from its first entry."""
        return self._ask("tables")

    def host_counts(self) -> list[dict[str, int] | None]:
        """Each worker's host-tier counters (the bytes its HostKVStore copied each way), asked between steps;
        None where the engine has no tier."""
        return self._ask("host")

    def _ask(self, word: str) -> list:
        self.check_alive()
        for conn in self.conns:
            conn.send((word, None))
        return [self._expect(rank, p, conn, word)
                for rank, (p, conn) in enumerate(zip(self.processes, self.conns), start=1)]

    def shutdown(self) -> None:
        """Stop every worker and wait for it (stop words first, then SIGTERM, then SIGKILL); idempotent."""
        for conn in self.conns:
            try:
                conn.send(("stop", None))
            except (OSError, ValueError):
                pass
        for p in self.processes:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
        for conn in self.conns:
            conn.close()
        self.conns = []
        self.failed = self.failed or "the engine was shut down"


def worker_main(rank: int, size: int, init_method: str, device: str, config: EngineConfig, conn,
                timeout_s: float) -> None:
    """A worker's life: join the group, build this rank's model runner (the same build as rank 0's, collective for
    collective), say ready, then run every step rank 0 announces until told to stop or orphaned."""
    try:
        conn.send(("hello", os.getpid()))
        device = rank_device(torch.device(device), rank)
        if device.type == "cpu":  # the ranks share the machine's cores
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
        tp = TensorParallel.connect(rank, size, init_method, device, timeout_s)
        runner, _, _ = build_rank(config, device, tp)
        conn.send(("ready", None))
        while True:
            kind, numel = conn.recv()  # the doorbell; EOFError once rank 0's process is gone
            if kind == "stop":
                tp.close()
                return
            if kind == "tables":  # rank 0 asks for this worker's block-table rows
                conn.send(("tables", runner.block_tables.held()))
                continue
            if kind == "host":  # ... or for its host tier's counters
                conn.send(("host", runner.host_store and {k: v for k, v in runner.stats.items()
                                                          if k.startswith("host_")}))
                continue
            plan, changes = unpack_plan(tp.broadcast_inputs(None, numel))
            runner.execute(plan, changes)  # rank 0's plan
            if kind == "step+tokens":  # rank 0's sampled tokens, for this rank's placeholders' inputs
                tp.broadcast_tokens(runner.last_token)
    except (EOFError, KeyboardInterrupt):
        return
    except BaseException as e:
        try:  # the traceback, and whether rank 0 raises it as a ValueError
            conn.send(("error", (traceback.format_exc(), isinstance(e, ValueError))))
        except OSError:
            pass
        raise SystemExit(1)
