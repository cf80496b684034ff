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

    def __init__(self, rank: int = 0, size: int = 1, backend: str | None = None, control_group=None):
        self.rank, self.size, self.backend = rank, size, backend
        self.control_group = control_group  # gloo: the steps' inputs travel between host memories
        self.all_reduces = self.bytes_all_reduced = self.bytes_gathered = 0
        self.all_reduce_s = 0.0  # host time in all_reduce calls: on the CPU (gloo) the wait for every rank included

    @classmethod
    def connect(cls, rank: int, size: int, init_method: str, device: torch.device,
                timeout_s: float = TIMEOUT_S) -> "TensorParallel":
        """Join the group of `size` ranks at init_method (rank 0's TCP address): NCCL on CUDA (this rank's GPU),
        gloo on the CPU. On CUDA a second group, gloo, carries the step's inputs between host memories."""
        import torch.distributed as dist

        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                                timeout=timedelta(seconds=timeout_s))
        control = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s)) if backend == "nccl" else None
        return cls(rank, size, backend, control)

    def close(self) -> None:
        import torch.distributed as dist

        if self.size > 1 and dist.is_initialized():
            dist.destroy_process_group()

    # ---- the collectives of the forward -------------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's x, on every rank (in place). size 1: x itself."""
        if self.size == 1:
            return x
        import torch.distributed as dist

        start = time.perf_counter()
        dist.all_reduce(x)
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
        dist.gather(local, parts, dst=0)
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

    # ---- the step's inputs -------------------------------------------------------------------------------
    def broadcast_inputs(self, packed: torch.Tensor | None, numel: int) -> torch.Tensor:
        """Rank 0's packed step (an int64 tensor of numel numbers, in host memory) -> the same on every rank."""
        import torch.distributed as dist

        buffer = packed if self.rank == 0 else torch.empty(numel, dtype=torch.int64)
        dist.broadcast(buffer, src=0, group=self.control_group)
        return buffer

    def broadcast_tokens(self, last_token: torch.Tensor) -> None:
        """Rank 0's last_token (each block-table row's newest sampled token, on its device) -> every rank's,
        in place, through the forward's group (NCCL on CUDA: device to device, queued behind the sampling)."""
        import torch.distributed as dist

        dist.broadcast(last_token, src=0)

    def agree_min(self, value: int) -> int:
        """The smallest of every rank's value (the KV pool's blocks: every rank must hold the same number)."""
        if self.size == 1:
            return value
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control_group)
        return int(t.item())


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
