"""Tensor parallelism: one model split across N processes ("ranks"), each holding 1/N of every layer's weights and of
the KV cache, joined by torch.distributed's collectives (NCCL between GPUs, gloo between CPU processes).

How a layer is cut (Megatron-LM's split, https://arxiv.org/abs/1909.08053), for N ranks:

    qkv_proj, gate_up_proj   column-parallel: each rank holds the output rows of its own heads (q, k and v of
                             heads/N query heads and kv_heads/N KV heads) and of its intermediate/N MLP columns.
                             The input is the full hidden state, which every rank has: no communication.
    attention                each rank attends with its own heads, over the K/V of its own KV heads: the KV
                             cache of a rank holds kv_heads/N heads, so the pool per rank is 1/N of the bytes.
    o_proj, down_proj        row-parallel: each rank holds the input columns that match its heads (its MLP
                             columns), so its product is a partial sum of the full one. One all-reduce (a sum
                             over ranks, the result on every rank) completes it: two all-reduces per layer.
    experts                  a mixture of experts' layer, two ways. By default each expert is cut as the MLP is
                             (its gate/up rows and its down columns): every rank holds 1/N of every expert.
                             enable_expert_parallel=True (vLLM's name) keeps the experts whole and splits them:
                             rank r holds experts r * E/N .. (r + 1) * E/N - 1 and runs only the tokens routed
                             there. Either way a rank's output is a partial sum, and one all-reduce completes it.
    embed_tokens, lm_head    vocab-parallel: each rank holds ceil(vocab/N) rows. The embedding looks up the ids
                             in its range, zeros for the rest, and one all-reduce sums the N lookups (exactly one
                             is not zero). lm_head gives each rank the logits of its rows; they are gathered on
                             rank 0, the only rank that samples.

Rank 0 is the engine (scheduler, block manager, sampler) in the user's process. Ranks 1..N-1 are worker processes
(worker.py starts them with the spawn method), each running the same forward as rank 0 when rank 0 tells it to: every
step, rank 0 rings a doorbell (a pipe per worker: "a step of this many numbers") and broadcasts the step's inputs as one
int64 tensor: the step's plan (scheduler.py's SchedulerOutput) as worker.py's pack_plan writes it, each row's start, new
tokens and known ids, its block-table row with the blocks it got since its last step, and whether its last new token is
a placeholder, filled on the device. A worker rebuilds the same plan (unpack_plan) and calls its own model runner's
execute on it, exactly what rank 0 runs; the collectives inside the forward meet rank 0's. Every worker keeps persistent
block-table rows of its own (model_runner.py's BlockTables) and writes the new blocks into the rows rank 0 names, so a
table crosses the pipe whole once, when its sequence takes a row, and then only block by block as it grows.

A worker exits when the engine stops it (shutdown), when its parent process is gone (the pipe from rank 0 closes
with the process that held its other end, however that process ended), or on an error (after sending the
traceback to rank 0). Rank 0 checks its workers are alive before every step, and every collective has a timeout:
a dead worker is an error on rank 0, not a hang.

This module is the group and the cut: it imports nothing of the step's own. The model (model.py, whose loader
reads a rank's shard), the runner and worker.py import it.
"""
from __future__ import annotations

import socket
import time
from datetime import timedelta

import torch

TIMEOUT_S = 120.0  # a collective (or a worker's start) that takes longer is an error, not a hang


def check_tensor_parallel_size(size, config=None, device: torch.device | None = None,
                               expert_parallel: bool = False) -> int:
    """tensor_parallel_size (vLLM's name) must be a positive int; given the model's config, one that divides its
    attention heads, KV heads and MLP width (each rank holds the same share); on CUDA, no more than the GPUs.
    A mixture of experts' experts (expert_parallel) or their width (not); expert_parallel on a model without
    experts is refused (there is nothing to split), at any size."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"tensor_parallel_size must be a positive int, got {size!r}")
    if config is None:
        return size
    if expert_parallel and not config.num_experts:
        raise ValueError(f"enable_expert_parallel=True: this model has no experts (a dense {config.model_type} model, "
                         "num_experts 0), so there are none to split over the ranks; leave it False")
    if config.num_heads % size or config.num_kv_heads % size:
        raise ValueError(f"tensor_parallel_size={size} must divide the model's attention heads and KV heads: "
                         f"{config.num_heads} heads and {config.num_kv_heads} KV heads do not split into {size} "
                         "equal shares")
    if config.intermediate_size % size:
        raise ValueError(f"tensor_parallel_size={size} must divide the model's MLP width, "
                         f"intermediate_size={config.intermediate_size}")
    if config.num_experts and expert_parallel and config.num_experts % size:  # whole experts per rank
        raise ValueError(f"enable_expert_parallel: tensor_parallel_size={size} must divide the model's experts, "
                         f"num_experts={config.num_experts} (each rank holds the same number of whole experts)")
    if config.num_experts and not expert_parallel and config.moe_intermediate_size % size:
        raise ValueError(f"tensor_parallel_size={size} must divide the experts' width, moe_intermediate_size="
                         f"{config.moe_intermediate_size} (or set enable_expert_parallel=True to split whole experts)")
    if device is not None and device.type == "cuda" and size > torch.cuda.device_count():
        raise ValueError(f"tensor_parallel_size={size} needs {size} GPUs (one per rank); "
                         f"this machine has {torch.cuda.device_count()}")
    return size


def rank_device(device: torch.device, rank: int) -> torch.device:
    """The device of a rank: the CPU for every rank on a CPU, GPU `rank` on CUDA."""
    return torch.device("cuda", rank) if device.type == "cuda" else torch.device("cpu")


def vocab_rows(vocab_size: int, size: int) -> int:
    """Rows of the embedding and lm_head per rank: ceil(vocab / N); the last rank's share is padded with zeros."""
    return -(-vocab_size // size)


def is_vocab_parallel(name: str) -> bool:
    return "embed_tokens" in name or name.startswith("lm_head")


def expert_of(name: str) -> int | None:
    """The expert a checkpoint tensor belongs to (HF's names: model.layers.L.mlp.experts.E.gate_proj.weight),
    or None (every other tensor, the router included)."""
    parts = name.split(".")
    return int(parts[parts.index("experts") + 1]) if "experts" in parts else None


def local_experts(num_experts: int, rank: int, size: int) -> range:
    """Expert parallel: the experts rank `rank` of `size` holds, whole: an equal run of consecutive ones."""
    per = num_experts // size
    return range(rank * per, (rank + 1) * per)


def shard(name: str, full_shape, rank: int, size: int, expert_parallel: bool = False):
    """Which part of the checkpoint tensor `name` rank `rank` of `size` holds: (dim, start, stop), or None when
    every rank holds all of it (the norms, a mixture of experts' router). An expert's tensors are cut as the
    MLP's are; with expert_parallel they are whole (None), and held by one rank only (local_experts)."""
    if expert_parallel and expert_of(name) is not None:
        return None
    if is_vocab_parallel(name):
        rows = vocab_rows(full_shape[0], size)
        return 0, min(rank * rows, full_shape[0]), min((rank + 1) * rows, full_shape[0])
    column = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # output rows: whole heads (the MLP: evenly)
    row = ("o_proj", "down_proj")  # input columns: the heads' (the MLP's) that match the column split
    kind = name.split(".")[-2]
    if kind in column:
        per = full_shape[0] // size
        return 0, rank * per, (rank + 1) * per
    if kind in row:
        per = full_shape[1] // size
        return 1, rank * per, (rank + 1) * per
    return None


class TensorParallel:
    """This rank's place in the group and its collectives. size 1: no group, and all_reduce / gather_logits are the
    identity, so a tp=1 forward runs exactly step21's operations.

    Counted (every rank counts its own, on the host; a replayed CUDA graph adds what its capture recorded):
    all_reduces and bytes_all_reduced (the tensors summed), bytes_gathered (the logits sent to rank 0)."""

    def __init__(self, rank: int = 0, size: int = 1, backend: str | None = None, control_group=None, group=None,
                 first: int = 0):
        self.rank, self.size, self.backend = rank, size, backend
        self.control_group = control_group  # gloo: the steps' inputs travel between host memories
        # the stage's ranks (pipeline parallel: each stage is a tensor-parallel group of its own; None: every rank),
        # and the global rank of its tp rank 0, where the logits are gathered
        self.group, self.first = group, first
        self.all_reduces = self.bytes_all_reduced = self.bytes_gathered = 0
        self.all_reduce_s = 0.0  # host time in all_reduce calls: on the CPU (gloo) the wait for every rank included


    # ---- the collectives of the forward -------------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's x, on every rank (in place). size 1: x itself."""
        if self.size == 1:
            return x
        import torch.distributed as dist

        start = time.perf_counter()
        dist.all_reduce(x, group=self.group)
        self.all_reduce_s += time.perf_counter() - start
        self.all_reduces += 1
        self.bytes_all_reduced += x.numel() * x.element_size()
        return x

    def gather_logits(self, local: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Each rank's logits of its vocab rows [S, rows] -> on rank 0 the whole [S, vocab] (the ranks' columns side
        by side, the padding cut off); on the other ranks, their own (unused). size 1: local itself."""
        if self.size == 1:
            return local
        import torch.distributed as dist

        local = local.contiguous()
        parts = [torch.empty_like(local) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(local, parts, dst=self.first, group=self.group)
        # counted as it crosses: what a worker sends, what rank 0 receives from the others
        self.bytes_gathered += local.numel() * local.element_size() * (self.size - 1 if self.rank == 0 else 1)
        if self.rank != 0:
            return local
        return torch.cat(parts, dim=-1)[:, :vocab_size]

    def counts(self) -> tuple[int, int, int]:
        return self.all_reduces, self.bytes_all_reduced, self.bytes_gathered

    def add(self, counts: tuple[int, int, int]) -> None:
        """Add what a replayed graph did (its capture's counts): a replay runs no Python, so nothing counts itself."""
        self.all_reduces += counts[0]
        self.bytes_all_reduced += counts[1]
        self.bytes_gathered += counts[2]

    # ---- overlap scheduling's tokens ----------------------------------------------------------------------
    def broadcast_tokens(self, last_token: torch.Tensor) -> None:
        """Rank 0's last_token (each block-table row's newest sampled token, on its device) -> every rank's,
        in place, through the forward's group (NCCL on CUDA: device to device, queued behind the sampling)."""
        import torch.distributed as dist

        dist.broadcast(last_token, src=0, group=self.group)

    def agree_min(self, value: int) -> int:
        """The smallest of every rank's value (the KV pool's blocks: every rank of every stage must hold the same
        number). No group: the value."""
        if self.control_group is None:
            return value
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control_group)  # every rank of every stage
        return int(t.item())


# ---- pipeline parallelism: stages of layers ------------------------------------------------------------------------
IDLE_TIMEOUT_S = 7 * 24 * 3600.0  # a worker waits this long for rank 0's next step (an idle server is not an error)
# what rank 0 sends a worker (the header's first number) and what a worker sends back (tags keep them apart)
STEP, STEP_TOKENS, STOP, ASK = 1, 2, 3, 4
RESULTS_TAG, REPLY_TAG = 1, 2


def check_pipeline_parallel_size(size, num_layers: int | None = None) -> int:
    """pipeline_parallel_size (vLLM's name): a positive int; given the model's layers, no more than them (each
    stage holds one layer at least)."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"pipeline_parallel_size must be a positive int, got {size!r}")
    if num_layers is not None and size > num_layers:
        raise ValueError(f"pipeline_parallel_size={size}: the model has {num_layers} layers, and each stage holds "
                         "one at least")
    return size


def stage_layers(num_layers: int, size: int, partition=None) -> list[range]:
    """The layers of each of `size` stages, contiguous, in order. By default as even as the count allows: every
    stage num_layers // size, and the layers left over one each to the stages before the last, from the last but
    one back (the first stage also embeds the tokens and the last one also runs the final norm and lm_head, so
    they take the extra layers last). partition (vLLM's VLLM_PP_LAYER_PARTITION, here an option): each stage's
    count, as "6,5,5" or a list; it must name `size` positive counts that add up to num_layers."""
    if partition is None or partition == "":
        counts = [num_layers // size] * size
        for i in range(num_layers % size):
            counts[-2 - i % max(size - 1, 1)] += 1
    else:
        text = partition if isinstance(partition, str) else ",".join(map(str, partition))
        try:
            counts = [int(part) for part in text.split(",")]
        except ValueError:
            raise ValueError(f"pp_layer_partition={partition!r}: a comma-separated list of layer counts, one per "
                             "stage (as 6,5,5)") from None
        if len(counts) != size or min(counts) < 1 or sum(counts) != num_layers:
            raise ValueError(f"pp_layer_partition={partition!r}: {size} stages need {size} positive counts adding "
                             f"up to the model's {num_layers} layers, got {counts} (sum {sum(counts)})")
    starts = [sum(counts[:i]) for i in range(size)]
    return [range(start, start + n) for start, n in zip(starts, counts)]


class Layout:
    """Ranks = tp x pp. Rank r is tensor-parallel rank r % tp of stage r // tp (vLLM's order: the ranks of a stage
    are consecutive, so a stage's tensor-parallel group is one machine's GPUs when torchrun starts a node per stage).
    Rank 0, the driver (the scheduler, the block manager, the sampler's results), is stage 0's tp rank 0."""

    def __init__(self, tp: int, pp: int, num_layers: int, partition=None):
        self.tp, self.pp, self.world = tp, pp, tp * pp
        self.layers = stage_layers(num_layers, pp, partition)

    def place(self, rank: int) -> tuple[int, int]:
        """rank -> (its stage, its tensor-parallel rank)."""
        return divmod(rank, self.tp)

    def rank(self, stage: int, tp_rank: int) -> int:
        return stage * self.tp + tp_rank

    def describe(self) -> str:
        """The mapping, as the engine's line prints it: one entry per rank."""
        parts = []
        for rank in range(self.world):
            stage, tp_rank = self.place(rank)
            layers = self.layers[stage]
            parts.append(f"rank {rank} = stage {stage} tp {tp_rank} (layers {layers.start}-{layers.stop - 1})")
        return "; ".join(parts)


class Pipeline:
    """This rank's stage and its point-to-point messages (pipeline_parallel_size 1: one stage, every layer, and
    nothing is sent). A stage's forward takes the residual stream [N, hidden] of the stage before (stage 0: the
    token ids) and gives its own to the stage after (the last stage: the logits). Each rank sends to the rank of the
    same tp rank in the next stage, asynchronously (isend: the sender goes on to its next batch); the receiver knows
    the size from the step's plan (N tokens). The last stage's tp rank 0 samples and sends the tokens back to rank 0.

    Rank 0 sends every other rank each step it schedules (send_step: a header, the packed plan and, to the rank that
    samples, the rows' sampling parameters), on a gloo group whose timeout is long (a worker waits there while
    the engine is idle); the results and the replies come back on another (TIMEOUT_S: an answer that does not come is
    an error). Sends are kept until they complete (their buffers must live)."""

    def __init__(self, rank: int = 0, layout: Layout | None = None, control=None, idle=None, hidden_group=None):
        self.rank, self.layout = rank, layout
        self.stage, self.tp_rank = layout.place(rank) if layout else (0, 0)
        self.size = layout.pp if layout else 1
        self.layers = layout.layers[self.stage] if layout else None  # None: every layer
        self.control, self.idle, self.hidden_group = control, idle, hidden_group
        self.pending: list = []  # (work, buffers) of sends not known complete
        self.bytes_sent = self.bytes_received = 0  # the residual streams between stages, counted by each rank
        self.timeline: list[tuple[float, float]] = []  # (start, end) of this rank's forward of each batch

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.size - 1

    @property
    def samples(self) -> bool:
        """The rank that samples: the last stage's tp rank 0 (rank 0 when there is one stage)."""
        return self.is_last and self.tp_rank == 0

    def _isend(self, tensor: torch.Tensor, dst: int, group, tag: int = 0) -> None:
        """Send without waiting for it (the tensor kept until the send completes). Under torch.profiler the send
        waits: the profiler's records of gloo's asynchronous sends crash the process when they are freed (torch 2.x),
        so a profiled run trades the overlap for a trace."""
        import torch.distributed as dist

        if torch.autograd.profiler._is_profiler_enabled:
            dist.send(tensor, dst, group=group, tag=tag)
            return
        self.pending = [(w, b) for w, b in self.pending if not w.is_completed()]
        self.pending.append((dist.isend(tensor, dst, group=group, tag=tag), tensor))

    def wait_sent(self) -> None:
        for work, _ in self.pending:
            work.wait()
        self.pending = []

    # ---- the residual stream between stages ---------------------------------------------------------------
    def send_hidden(self, x: torch.Tensor) -> None:

        x = x.contiguous()
        self._isend(x, self.layout.rank(self.stage + 1, self.tp_rank), self.hidden_group)
        self.bytes_sent += x.numel() * x.element_size()

    def recv_hidden(self, num_tokens: int, hidden_size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        import torch.distributed as dist

        x = torch.empty(num_tokens, hidden_size, dtype=dtype, device=device)
        dist.recv(x, self.layout.rank(self.stage - 1, self.tp_rank), group=self.hidden_group)
        self.bytes_received += x.numel() * x.element_size()
        return x

    # ---- rank 0's steps to the workers, and what comes back --------------------------------------------------
    def send_step(self, kind: int, packed: torch.Tensor, sampling: bytes | None = None) -> None:
        """Rank 0: the step to every other rank: [kind, plan's numel, sampling's bytes], then the plan (int64) and,
        to the rank that samples, the sampling (a pickled list, as uint8)."""
        sampler = self.layout.rank(self.size - 1, 0)
        blob = bytes_tensor(sampling) if sampling else None
        for rank in range(1, self.layout.world):
            extra = blob if rank == sampler and blob is not None else None
            header = torch.tensor([kind, packed.numel(), 0 if extra is None else extra.numel()], dtype=torch.int64)
            self._isend(header, rank, self.idle)
            self._isend(packed, rank, self.idle)
            if extra is not None:
                self._isend(extra, rank, self.idle)

    def send_word(self, kind: int, word: int = 0) -> None:
        """Rank 0: a header with no plan (STOP, or ASK with what is asked) to every other rank."""
        for rank in range(1, self.layout.world):
            self._isend(torch.tensor([kind, word, 0], dtype=torch.int64), rank, self.idle)

    def recv_step(self) -> tuple[int, torch.Tensor | None, bytes | None]:
        """A worker: the next header from rank 0 and what follows it -> (kind, the packed plan or the word asked,
        the pickled sampling or None)."""
        import torch.distributed as dist

        header = torch.empty(3, dtype=torch.int64)
        dist.recv(header, 0, group=self.idle)
        kind, numel, extra = header.tolist()
        if kind not in (STEP, STEP_TOKENS):
            return kind, numel, None
        packed = torch.empty(numel, dtype=torch.int64)
        dist.recv(packed, 0, group=self.idle)
        blob = None
        if extra:
            blob = torch.empty(extra, dtype=torch.uint8)
            dist.recv(blob, 0, group=self.idle)
            blob = blob.numpy().tobytes()
        return kind, packed, blob

    def send_results(self, values: torch.Tensor) -> None:
        """The rank that samples: a step's tokens (and logprobs) to rank 0, float64."""
        self._isend(values, 0, self.control, RESULTS_TAG)

    def expect_results(self, numel: int):
        """Rank 0: post the receive of a step's results (numel float64 values) now; -> (work, buffer): wait, read."""
        import torch.distributed as dist

        buffer = torch.empty(numel, dtype=torch.float64)
        return dist.irecv(buffer, self.layout.rank(self.size - 1, 0), group=self.control, tag=RESULTS_TAG), buffer

    def reply(self, blob: bytes) -> None:
        """A worker's answer to rank 0's question (pickled): its size, then its bytes."""
        import torch.distributed as dist

        data = bytes_tensor(blob)
        dist.send(torch.tensor([data.numel()], dtype=torch.int64), 0, group=self.control, tag=REPLY_TAG)
        dist.send(data, 0, group=self.control, tag=REPLY_TAG)

    def replies(self) -> list[bytes]:
        """Rank 0: every worker's answer, in rank order."""
        import torch.distributed as dist

        out = []
        for rank in range(1, self.layout.world):
            size = torch.empty(1, dtype=torch.int64)
            dist.recv(size, rank, group=self.control, tag=REPLY_TAG)
            data = torch.empty(int(size.item()), dtype=torch.uint8)
            dist.recv(data, rank, group=self.control, tag=REPLY_TAG)
            out.append(data.numpy().tobytes())
        return out


def idle_shares(timelines: list[list[tuple[float, float]]]) -> list[float]:
    """Pipeline bubbles, from each stage's recorded forwards [(start, end)] (one clock: time.perf_counter on one
    machine): over the window from the first stage's first start to the last stage's last end, the share of it each
    stage spent not computing. With one batch in flight a stage of pp waits for the other pp - 1 (about 1 - 1/pp
    idle); with pp batches in flight they overlap and the share falls."""
    begin = min(start for line in timelines for start, _ in line)
    end = max(stop for line in timelines for _, stop in line)
    return [1 - sum(stop - start for start, stop in line) / (end - begin) for line in timelines]


def bytes_tensor(blob: bytes) -> torch.Tensor:
    """Bytes -> a uint8 tensor that owns a copy of them (what a send needs alive until it completes)."""
    import numpy as np

    return torch.from_numpy(np.frombuffer(blob, dtype=np.uint8).copy())


def connect(rank: int, layout: Layout, init_method: str, device: torch.device,
            timeout_s: float = TIMEOUT_S) -> tuple[TensorParallel, Pipeline]:
    """Join the group of every rank (tp x pp) at init_method (rank 0's TCP address, or "env://" under torchrun):
    NCCL on CUDA (this rank's GPU), gloo on the CPU. Then the groups, made in the same order on every rank: a gloo
    group for what travels between host memories (results, replies, the pool's size), one with a long timeout
    for rank 0's steps, and, with several stages of several ranks, each stage's own tensor-parallel group.
    -> (this rank's TensorParallel within its stage, its Pipeline)."""
    import torch.distributed as dist

    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=layout.world,
                            timeout=timedelta(seconds=timeout_s))
    control = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    idle = dist.new_group(backend="gloo", timeout=timedelta(seconds=IDLE_TIMEOUT_S))
    stage, tp_rank = layout.place(rank)
    group = None  # one stage: the world is the tensor-parallel group
    if layout.pp > 1:
        for s in range(layout.pp):  # every rank makes every group, in order
            made = dist.new_group([layout.rank(s, t) for t in range(layout.tp)]) if layout.tp > 1 else None
            group = made if s == stage else group
    tp = TensorParallel(tp_rank, layout.tp, backend, control, group, first=layout.rank(stage, 0))
    return tp, Pipeline(rank, layout, control, idle, hidden_group=None)


def close_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


# ---- what the worker processes share with rank 0 ----------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class WorkerError(RuntimeError):
    """A tensor-parallel worker died, failed or did not answer: the engine cannot run a step without it."""


class WorkerValueError(WorkerError, ValueError):
    """A worker's ValueError, raised on rank 0: a bad option, or a checkpoint that does not fit that rank's share,
    is a ValueError to the caller, as it is on one rank; still a WorkerError, whose message names the worker and
    ends with the worker's own error."""
