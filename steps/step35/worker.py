"""A rank: how one is built, and the workers that hold ranks 1..N-1 (parallel.py says how the model is cut: tp ranks
in each of pp stages).

build_rank is the whole of a rank's set-up, from the engine's config (config.py): its share of the model (its stage's
layers, its tensor-parallel share of each), the attention backend, the KV cache and the CUDA graphs. Rank 0 (the
engine, in the user's process) and every worker run this same build, so the collectives inside it meet.

The workers are started one of two ways, and run the same code once they have joined the group:
    distributed_executor_backend="mp" (the default, vLLM's name): rank 0 starts them with the spawn method, each
        given the config (start_workers), and keeps a pipe per worker for its words (hello, ready, error) and the
        process to watch (Workers).
    "external_launcher" (vLLM's name): torchrun started every rank, on one machine or several (`torchrun --nnodes N
        --node-rank R --master-addr A --nproc-per-node G run.py ...`); rank 0 runs the engine, every other rank calls
        run_torchrun_worker, and they meet at torchrun's rendezvous (init_method "env://"). There is no launcher of
        ours: a rank that fails ends, and torchrun ends the others.
Either way rank 0 sends each step to every worker over torch.distributed (parallel.py's Pipeline.send_step: the
packed plan, and the sampling to the rank that samples), and asks them questions the same way (their block-table
rows, their host tier's counters, their stage's figures). A worker's life is serve_steps: run every step rank 0
sends, until told to stop or until rank 0 is gone.

Layers: engine.py imports this module; this module imports the engine's config (config.py), the model, the runner,
the attention backends and parallel.py; none of those imports it back.
"""
from __future__ import annotations

import gc
import os
import pickle
import threading
import time
import traceback

import torch

from .attention import BACKENDS
from .config import EngineConfig
from .model import CausalLM
from .model_runner import ModelRunner
from .offload import HostKVStore
from .parallel import (ASK, STEP, STEP_TOKENS, STOP, TIMEOUT_S, Layout, Pipeline, TensorParallel,  # noqa: F401
                       WorkerError, WorkerValueError, close_group, connect, free_port, rank_device)
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


def graphs_off_reason(enforce_eager: bool, device: torch.device, attention_backend: str,
                      pipeline_parallel_size: int = 1) -> str | None:
    """Why this engine runs without CUDA graphs, or None when it captures them."""
    if enforce_eager:
        return "enforce_eager=True"
    if device.type != "cuda":
        return f"the device is {device.type}: CUDA graphs need a CUDA GPU"
    if attention_backend != "triton":
        return "attention_backend='torch' builds each step's metadata on the host, so it cannot be replayed"
    if pipeline_parallel_size > 1:
        return (f"pipeline_parallel_size={pipeline_parallel_size}: a stage's input is the stream the stage before "
                "sent, which this step's graphs do not capture")
    return None


def new_stats() -> dict:
    """The engine's counters. rows: summed. graph_replays (forwards replayed from a graph), eager_forwards,
    padded_rows (rows added to fill a bucket), syncs (waits for the GPU: one per step that samples, on CUDA).
    verify_replays (verify steps replayed from a graph)."""
    return {"prefill_chunks": 0, "decode_steps": 0, "decode_rows": 0, "forwards": 0, "graph_replays": 0,
            "eager_forwards": 0, "padded_rows": 0, "syncs": 0, "verify_replays": 0}


def layout_of(config: EngineConfig) -> Layout:
    """The engine's ranks: tensor_parallel_size x pipeline_parallel_size, the layers split as pp_layer_partition
    says (or evenly)."""
    return Layout(config.tensor_parallel_size, config.pipeline_parallel_size, config.model_config.num_layers,
                  config.pp_layer_partition)


def build_rank(config: EngineConfig, device: torch.device, tp: TensorParallel, pipe: Pipeline | None = None):
    """One rank's model runner, as the engine's config says: its share of the model (its stage's layers), the
    attention backend, the KV cache (sized, on CUDA, by a profiled forward) and the CUDA graphs. Rank 0 (the engine)
    and every worker run this same build, on its own device, so the collectives in its forwards meet. The verify
    steps' graphs too (config.verify_graphs: k + 1 tokens per row, up to the largest batch that drafts).
    -> (runner, memory, cuda_graphs)."""
    c = config
    pipe = pipe or Pipeline()
    model = CausalLM.from_pretrained(c.model_dir, device, c.dtype, tp, c.gguf_file, c.quantization,
                                     c.enable_expert_parallel, pipe)
    # One object decides how attention runs: its metadata every step (the runner), its attention every layer
    # (the model). attention.py: TorchAttention (step14_7's loop) or TritonAttention (the kernels).
    model.attention_backend = BACKENDS[c.attention_backend](model.config, device)
    if c.attention_backend == "triton":  # the kernels' path: the layer's elementwise groups fused (kernels/fused.py)
        from .kernels.fused import TritonLayerOps
        model.ops = TritonLayerOps()
    off = graphs_off_reason(c.enforce_eager, device, c.attention_backend, c.pipeline_parallel_size)
    runner = ModelRunner(model, device, c.dtype, PhaseTimers(device), new_stats(), c.kv_cache_dtype,
                         use_graphs=off is None, max_num_seqs=c.max_running_seqs, verify=c.verify_graphs)
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


def torchrun_env() -> dict | None:
    """This process's place when torchrun started it (RANK, WORLD_SIZE, LOCAL_RANK, set by torch.distributed's
    launcher), or None."""
    if "TORCHELASTIC_RUN_ID" not in os.environ and "LOCAL_RANK" not in os.environ:
        return None
    return {"rank": int(os.environ["RANK"]), "world": int(os.environ["WORLD_SIZE"]),
            "local_rank": int(os.environ.get("LOCAL_RANK", 0))}


def start_workers(config: EngineConfig, device: torch.device):
    """Rank 0: start the other ranks (or, under torchrun, find them at the rendezvous) and join the group.
    -> (Workers, rank 0's TensorParallel, rank 0's Pipeline)."""
    import torch.distributed as dist

    if dist.is_initialized():
        raise RuntimeError("a parallel engine is already running in this process: shutdown() it first "
                           "(torch.distributed holds one group per process)")
    layout = layout_of(config)
    external = config.distributed_executor_backend == "external_launcher"
    workers = Workers(config, device, layout, external)
    try:
        workers.wait_started()
        tp, pipe = connect(0, layout, "env://" if external else workers.init_method, rank_device(device, 0),
                           workers.timeout_s)
        workers.pipe = pipe
    except BaseException:
        workers.shutdown()
        raise
    return workers, tp, pipe


def stop_workers(workers: Workers, tp: TensorParallel) -> None:
    workers.shutdown()
    # garbage that still holds a send's or a receive's handle is freed while its group lives (a handle freed after
    # the group is gone crashes the process: torch.profiler's records of the calls keep them in reference cycles)
    gc.collect()
    close_group()


# ---- the workers ---------------------------------------------------------------------------------------------
ASKED = {"tables": 1, "host": 2, "stage": 3}  # what rank 0 may ask a worker between steps


class Workers:
    """Rank 0's handle on ranks 1..N-1: starts them (unless torchrun did), sends them each step, asks them, stops
    them. Holds no reference to the engine, so the engine's finaliser can stop them when the engine goes away."""

    def __init__(self, config: EngineConfig, device: torch.device, layout: Layout, external: bool = False,
                 timeout_s: float = TIMEOUT_S):
        import multiprocessing as mp

        self.size, self.layout, self.timeout_s, self.external = layout.world, layout, timeout_s, external
        self.init_method = None if external else f"tcp://127.0.0.1:{free_port()}"
        self.failed: str | None = None
        self.processes, self.conns = [], []
        self.pipe: Pipeline | None = None  # rank 0's, once it has joined the group
        if external:  # torchrun started every rank
            return
        ctx = mp.get_context("spawn")
        for rank in range(1, self.size):
            parent_end, child_end = ctx.Pipe()
            p = ctx.Process(target=worker_main, name=f"worker-{rank}", daemon=True,
                            args=(rank, layout, self.init_method, str(device), config, child_end, timeout_s))
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
        """Every worker has loaded its shard and built its cache (and graphs): wait for each one's word (torchrun's
        workers: a barrier, after which each has built)."""
        if self.external:
            import torch.distributed as dist

            dist.barrier(group=self.pipe.control)
            return
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
        self._fail(f"{self.name(rank, p)} did not get {word} within {self.timeout_s:.0f} s")

    def _fail(self, error: WorkerError | str):
        error = error if isinstance(error, WorkerError) else WorkerError(error)
        self.failed = self.failed or str(error)
        raise error

    def _error(self, rank: int, p, detail) -> WorkerError:
        """What a worker reported, ("error", (its traceback, whether it was a ValueError)), as the error rank 0 raises,
        naming the worker (and its stage): a ValueError stays one (WorkerValueError: a bad option or a checkpoint that
        does not fit that rank's share is the caller's ValueError, as it is on one rank), anything else a WorkerError."""
        text, value_error = detail if isinstance(detail, tuple) else (detail, False)
        return (WorkerValueError if value_error else WorkerError)(f"{self.name(rank, p)} failed:\n{text}")

    def name(self, rank: int, p=None) -> str:
        pid = f"pid {p.pid}" if p is not None else "started by torchrun"
        if self.layout.pp == 1:
            return f"tensor-parallel worker {rank} ({pid})"
        stage, tp_rank = self.layout.place(rank)
        return f"worker {rank} (stage {stage}, tp rank {tp_rank}, {pid})"

    def stop_steps(self, reason: WorkerError | str) -> None:
        """No step may run any more (the ranks are out of step): every later step raises WorkerError(reason)."""
        self.failed = self.failed or str(reason)

    def failure(self, wait_s: float) -> WorkerError | None:
        """What a worker reported or how it ended, waiting up to wait_s for it, as the error to raise (_error): after
        rank 0's own build or step failed (a worker's error usually comes first, and rank 0 only saw the connection
        close). None: none (always, under torchrun: a rank that fails ends, and torchrun ends the others)."""
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
                    return WorkerError(f"{self.name(rank, p)} died with exit code {p.exitcode}")
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
        """Send every worker the step (the plan, with its block-table changes and the host tier's copies: pack_plan;
        to the rank that samples, when it is not rank 0, each row's sampling): the workers run the same copies and
        their forwards from here. share_tokens: after the forward each worker also receives rank 0's last_token."""
        self.check_alive()
        packed = pack_plan(plan, changes)
        sampling = pickle.dumps(plan.sampling) if self.layout.pp > 1 and plan.sample_rows else None
        try:
            self.pipe.send_step(STEP_TOKENS if share_tokens else STEP, packed, sampling)
        except Exception as e:  # a socket closed under us: a worker went away
            # its end may show a moment after its socket closed (a killed process is reaped after the reset)
            self._fail(self.failure(wait_s=1) or f"a parallel step failed: {e}")

    def block_tables(self) -> list[dict[int, list[int]]]:
        """Each worker's block-table rows as it holds them now, {row: its blocks} (BlockTables.held), asked between
        steps: what a test compares with rank 0's own rows. A worker hears of no release: a row rank 0 has freed
        keeps its last table there until rank 0 hands the row out again, whole from its first entry."""
        return self._ask("tables")

    def host_counts(self) -> list[dict[str, int] | None]:
        """Each worker's host-tier counters (the bytes its HostKVStore copied each way), asked between steps;
        None where the engine has no tier."""
        return self._ask("host")

    def stages(self) -> list[dict]:
        """Each worker's stage figures (stage_report): its layers, its KV cache's bytes, the bytes it sent and
        received, the (start, end) of each forward it ran; asked between steps."""
        return self._ask("stage")

    def _ask(self, word: str) -> list:
        self.check_alive()
        try:
            self.pipe.send_word(ASK, ASKED[word])
            return [pickle.loads(blob) for blob in self.pipe.replies()]
        except Exception as e:
            self._fail(self.failure(wait_s=1) or f"asking the workers for {word} failed: {e}")

    def shutdown(self) -> None:
        """Stop every worker and wait for it (the stop word first, then SIGTERM, then SIGKILL); idempotent."""
        if self.pipe is not None and not self.failed:
            try:
                self.pipe.send_word(STOP)
                self.pipe.wait_sent()
            except Exception:  # noqa: BLE001 (a worker gone already: the processes are ended below)
                pass
        self.pipe = None
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


def stage_report(runner: ModelRunner) -> dict:
    """A rank's stage, as a test or a benchmark reads it: its layers, its KV cache's bytes, the residual streams'
    bytes it sent and received, the (start, end) of every forward it ran (time.perf_counter: one clock for the
    processes of a machine)."""
    pipe = runner.model.pipe
    layers = runner.model.config.layers
    return {"rank": pipe.rank, "stage": pipe.stage, "layers": (layers.start, layers.stop),
            "kv_bytes": runner.kv_cache.nbytes, "bytes_sent": pipe.bytes_sent, "bytes_received": pipe.bytes_received,
            "timeline": list(pipe.timeline), "forwards": runner.stats["forwards"]}


def serve_steps(runner: ModelRunner, tp: TensorParallel, pipe: Pipeline) -> None:
    """A worker's loop: every step rank 0 sends is run as rank 0 planned it (execute_stage: this stage's forward,
    the stream to the next stage or, on the rank that samples, the tokens back to rank 0), every question answered,
    until the stop word."""
    while True:
        kind, packed, sampling = pipe.recv_step()
        if kind == STOP:
            pipe.wait_sent()
            return
        if kind == ASK:
            word = {v: k for k, v in ASKED.items()}[packed]
            answer = (runner.block_tables.held() if word == "tables" else stage_report(runner) if word == "stage"
                      else runner.host_store and {k: v for k, v in runner.stats.items() if k.startswith("host_")})
            pipe.reply(pickle.dumps(answer))
            continue
        plan, changes = unpack_plan(packed)
        if sampling is not None:
            plan.sampling = pickle.loads(sampling)
        runner.execute_stage(plan, changes)  # rank 0's plan
        if kind == STEP_TOKENS:  # rank 0's sampled tokens, for this rank's placeholders' inputs
            tp.broadcast_tokens(runner.last_token)


def _watch_parent(conn) -> None:
    """A spawned worker: rank 0 never writes to the pipe, so a read returns only when its process is gone: exit."""
    try:
        while True:
            conn.recv()
    except (EOFError, OSError):
        os._exit(0)


def worker_main(rank: int, layout: Layout, init_method: str, device: str, config: EngineConfig, conn,
                timeout_s: float) -> None:
    """A spawned worker's life: join the group, build this rank's model runner (the same build as rank 0's,
    collective for collective), say ready, then serve rank 0's steps until told to stop or orphaned."""
    try:
        conn.send(("hello", os.getpid()))
        threading.Thread(target=_watch_parent, args=(conn,), name="parent watch", daemon=True).start()
        device = rank_device(torch.device(device), rank)
        if device.type == "cpu":  # the ranks share the machine's cores
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // layout.world))
        tp, pipe = connect(rank, layout, init_method, device, timeout_s)
        runner, _, _ = build_rank(config, device, tp, pipe)
        conn.send(("ready", None))
        serve_steps(runner, tp, pipe)
        close_group()
    except KeyboardInterrupt:
        return
    except BaseException as e:
        try:  # the traceback, and whether rank 0 raises it as a ValueError
            conn.send(("error", (traceback.format_exc(), isinstance(e, ValueError))))
        except OSError:
            pass
        raise SystemExit(1)


def run_torchrun_worker(config: EngineConfig) -> None:
    """A rank > 0 that torchrun started: join the group at torchrun's rendezvous, build this rank, meet rank 0 at the
    barrier that says every rank is built, then serve its steps until the stop word. Its errors end the process
    (torchrun then ends the others)."""
    env = torchrun_env()
    layout = layout_of(config)
    if env is None or env["world"] != layout.world:
        raise ValueError(f"distributed_executor_backend='external_launcher': torchrun must start tensor_parallel_size "
                         f"x pipeline_parallel_size = {layout.world} processes, WORLD_SIZE is "
                         f"{None if env is None else env['world']}")
    device = torch.device("cuda", env["local_rank"]) if config.device.type == "cuda" else torch.device("cpu")
    tp, pipe = connect(env["rank"], layout, "env://", device)
    runner, _, _ = build_rank(config, device, tp, pipe)
    import torch.distributed as dist

    dist.barrier(group=pipe.control)
    serve_steps(runner, tp, pipe)
    close_group()
