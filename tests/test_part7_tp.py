"""step22: tensor parallelism. The model is split over N ranks (this process and N - 1 spawned workers) joined by
torch.distributed, gloo on the CPU: every test here runs in CI.

- The loader: each rank's shards of every weight reassemble to the checkpoint's tensors.
- The engine: tp=2 on both tiny families and tp=3 on the real model give tp=1's tokens, with logprobs within
  TP_LOGPROB_ATOL_FP32 (helpers.py says why), while preemption and prefix caching happen (their counters).
- The collectives happened: two all-reduces per layer and one for the embedding in every forward, of the bytes
  they should have.
- The block tables: each worker keeps its own persistent rows, equal to rank 0's after every step, while every
  step's broadcast carries only the blocks that are new since the sequence's last step (none in a decode step that
  crosses no block boundary), never a whole table but the first time.
- Sizes that do not split the heads are refused before any process starts; a worker's ValueError is a ValueError
  on rank 0 (naming the worker), and one every rank raises is rank 0's own; a killed worker is an error, not a
  hang; no worker is left after shutdown(), after the engine is collected, or after its process ends.
On the GPU (marked gpu): tp=1 equals step21, and tp=2 on one GPU is refused by name.
"""
import gc
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from helpers import (TP_LOGPROB_ATOL_FP32, RowWrites, alive, child_processes, compare_completions, edited_model,
                     load_engine, shell_env, step_module)
from registry import having, introducing, last_before, lesson_and_newest
from shared import SamplingParams, resolve_model

TP = introducing("tensor_parallel")
BEFORE = last_before("tensor_parallel")
ROOT = Path(__file__).resolve().parents[1]


def parallel():
    return step_module(TP, "parallel")


# ---- the loader -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("model,size", [("random:tiny-llama", 2), ("random:tiny-qwen3", 2), ("smollm2-135m", 3)])
def test_sharded_weights_reassemble_to_the_full_tensors(model, size):
    from safetensors.torch import load_file

    p = parallel()
    model_dir = resolve_model(model)
    files = sorted(model_dir.glob("*.safetensors"))
    full = {}
    for f in files:
        full.update(load_file(f))
    shards = [step_module(TP, "model").load_shard(files, rank, size, torch.device("cpu"), torch.float32) for rank in range(size)]
    config = step_module(TP, "model").ModelConfig.from_json(model_dir / "config.json")
    for name, tensor in full.items():
        parts = [s[name] for s in shards]
        cut = p.shard(name, tensor.shape, 0, size)
        if cut is None:  # norms: every rank holds all of it
            assert all(torch.equal(part, tensor.float()) for part in parts), name
            continue
        whole = torch.cat(parts, dim=cut[0])
        if "embed_tokens" in name or name.startswith("lm_head"):  # padded to ceil(vocab / N) rows per rank
            assert whole.shape[0] == size * p.vocab_rows(config.vocab_size, size)
            assert not whole[tensor.shape[0]:].any()
            whole = whole[:tensor.shape[0]]
        assert torch.equal(whole, tensor.float()), name
        assert all(part.shape[cut[0]] * size >= tensor.shape[cut[0]] for part in parts)
    # each rank's model: its share of the heads, KV heads and MLP, in the fused matrices the forward reads
    local = step_module(TP, "model").rank_config(config, size)
    q_rows = (local.num_heads + 2 * local.num_kv_heads) * local.head_dim
    layer = "model.layers.0."
    assert (local.num_heads, local.num_kv_heads) == (config.num_heads // size, config.num_kv_heads // size)
    rank1 = step_module(TP, "model").fuse_projections(shards[1], local)
    assert rank1[layer + "self_attn.qkv_proj.weight"].shape == (q_rows, config.hidden_size)
    assert rank1[layer + "mlp.gate_up_proj.weight"].shape == (2 * config.intermediate_size // size, config.hidden_size)
    assert rank1[layer + "mlp.down_proj.weight"].shape == (config.hidden_size, config.intermediate_size // size)


# ---- the engine: tp > 1 equals tp = 1 -------------------------------------------------------------------
def shared_prefix_prompts(vocab_size: int, num: int = 6) -> list[list[int]]:
    """Prompts that share a 32-token prefix (two blocks of 16: prefix cache hits), each with its own tail."""
    g = torch.Generator().manual_seed(7)
    prefix = torch.randint(0, vocab_size, (32,), generator=g).tolist()
    return [prefix + torch.randint(0, vocab_size, (5 + 3 * i,), generator=g).tolist() for i in range(num)]


def generate_both(model, size, prompts, params, **options):
    """The same requests through tp=1 and tp=size of step22 -> (outputs, outputs, the tp engine's counters)."""
    LLM = load_engine(TP).LLM
    ref = LLM(model, device="cpu", dtype="float32", **options).generate(prompts, params)
    llm = LLM(model, device="cpu", dtype="float32", tensor_parallel_size=size, **options)
    try:
        assert llm.tp.size == size and len(llm.workers.pids) == size - 1
        assert f"tensor parallel: {size} ranks (gloo)" in llm.backend
        out = llm.generate(prompts, params)
        counters = dict(preemptions=llm.scheduler.num_preemptions, hits=llm.block_manager.stats["hits"],
                        forwards=llm.stats["forwards"], all_reduces=llm.tp.all_reduces,
                        bytes_all_reduced=llm.tp.bytes_all_reduced, bytes_gathered=llm.tp.bytes_gathered,
                        layers=llm.model.config.num_layers, hidden=llm.model.config.hidden_size,
                        heads=llm.model.config.num_heads, kv_heads=llm.model.config.num_kv_heads,
                        cache_heads=llm.kv_cache.data.shape[4])
    finally:
        llm.shutdown()
    return ref, out, counters


@pytest.mark.parametrize("model", ["random:tiny-llama", "random:tiny-qwen3"])
def test_tp2_equals_tp1_with_preemption_and_prefix_caching(model):
    vocab = 49152
    prompts = shared_prefix_prompts(vocab)
    params = [SamplingParams(temperature=0, max_tokens=20 + i, ignore_eos=True, logprobs=2) for i in range(6)]
    # 128 KV tokens for six requests of ~60: the scheduler must preempt; the shared prefix is found in the cache
    ref, out, n = generate_both(model, 2, prompts, params, max_kv_tokens=128, max_num_seqs=4,
                                max_num_batched_tokens=64)
    assert n["preemptions"] > 0 and n["hits"] > 0, n
    assert n["kv_heads"] == n["cache_heads"] == 1 and n["heads"] == 2  # each rank: half of 4 heads, of 2 KV heads
    for i, (a, b) in enumerate(zip(out, ref)):
        compare_completions(a.outputs[0], b.outputs[0], TP_LOGPROB_ATOL_FP32, label=f"tp=2 prompt {i}")
    # every forward: the embedding's all-reduce, then o_proj's and down_proj's in every layer
    assert n["all_reduces"] == n["forwards"] * (2 * n["layers"] + 1)


def test_the_bytes_all_reduced_are_a_hidden_state_per_token_per_all_reduce():
    """No prefix caching, no preemption: each prompt token and each generated token but the last is computed once,
    and every all-reduce carries its rows' hidden states (fp32); rank 0 receives the other rank's vocab half."""
    prompts = shared_prefix_prompts(49152, num=3)
    params = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)
    ref, out, n = generate_both("random:tiny-llama", 2, prompts, params, enable_prefix_caching=False)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in ref]
    tokens = sum(map(len, prompts)) + 3 * (9 - 1)
    assert n["preemptions"] == 0
    assert n["bytes_all_reduced"] == tokens * (2 * n["layers"] + 1) * n["hidden"] * 4
    sampled_rows = 3 * 9  # one row of logits per token sampled; rank 0 gets the other rank's 49152 / 2 columns
    assert n["bytes_gathered"] == sampled_rows * (49152 // 2) * 4


def test_workers_keep_rank_0s_rows_and_the_broadcast_carries_only_new_blocks(monkeypatch):
    """tp=2 in a pool of 128 KV tokens (preemption, rows reused): after every step each worker's rows (asked over its
    pipe) hold what rank 0's hold for every sequence that has one; the blocks a step's broadcast carries are exactly
    the entries rank 0 wrote into its own rows; the tokens are tp=1's."""
    p = parallel()
    sent = []  # per step: (sequences, new tokens, blocks carried, blocks in their whole tables, numbers broadcast)
    pack = p.pack_work

    def counted(work, changes):
        packed = pack(work, changes)
        sent.append((len(work), sum(n for _, n in work), sum(len(new) for _, _, new in changes),
                     sum(len(seq.block_table) for seq, _ in work), packed.numel()))
        return packed

    monkeypatch.setattr(step_module(TP, "worker"), "pack_work", counted)  # rank 0's Workers.start_step packs with it
    prompts = shared_prefix_prompts(49152, num=5)
    params = [SamplingParams(temperature=0, max_tokens=18 + 3 * i, ignore_eos=True, logprobs=1) for i in range(5)]
    options = dict(device="cpu", dtype="float32", max_kv_tokens=128, max_num_seqs=4, max_num_batched_tokens=64)
    LLM = load_engine(TP).LLM
    ref = LLM("random:tiny-llama", **options).generate(prompts, params)
    llm = LLM("random:tiny-llama", tensor_parallel_size=2, **options)
    try:
        tables = llm.runner.block_tables
        for prompt, sp in zip(prompts, params):
            llm.add_request(prompt, sp)
        outs, quiet_decode_steps, compared = [], 0, 0
        while llm.has_unfinished_requests():
            with RowWrites(tables) as writes:  # the entries written into rank 0's rows, as the operators run
                outs += llm.step()
            num, new_tokens, carried, whole, numel = sent[-1]
            assert carried == writes.entries  # what rank 0 wrote into its rows, and nothing more
            assert numel == 1 + 6 * num + new_tokens + carried
            quiet_decode_steps += new_tokens == num and carried == 0
            (worker,) = llm.workers.block_tables()
            mine = tables.held()
            for row in tables.row_of.values():
                assert worker[row] == mine[row], f"row {row}: worker 1 holds {worker[row]}, rank 0 {mine[row]}"
                compared += 1
        assert llm.scheduler.num_preemptions > 0 and quiet_decode_steps > 0 and compared > 0
        print(f"blocks broadcast: {sum(s[2] for s in sent)}, whole tables every step: {sum(s[3] for s in sent)}; "
              f"{quiet_decode_steps} decode steps with none; preemptions {llm.scheduler.num_preemptions}")
        assert sum(s[2] for s in sent) < sum(s[3] for s in sent) / 4  # far fewer than whole tables every step
    finally:
        llm.shutdown()
    for i, (a, b) in enumerate(zip(sorted(outs, key=lambda o: int(o.request_id)), ref)):
        compare_completions(a.outputs[0], b.outputs[0], TP_LOGPROB_ATOL_FP32, label=f"tp=2 prompt {i}")


@pytest.mark.slow
def test_tp3_on_the_real_model_equals_tp1():
    """SmolLM2-135M: 9 heads and 3 KV heads, so three ranks of 3 heads and one KV head each."""
    prompts = ["The capital of France is", "def fibonacci(n):", "Tensor parallelism splits"]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1)
    ref, out, n = generate_both("smollm2-135m", 3, prompts, params)
    assert n["heads"] == 3 and n["kv_heads"] == 1
    for i, (a, b) in enumerate(zip(out, ref)):
        compare_completions(a.outputs[0], b.outputs[0], TP_LOGPROB_ATOL_FP32, label=f"tp=3 prompt {i}")
    assert n["all_reduces"] == n["forwards"] * (2 * 30 + 1)


# ---- bad sizes, dead workers, no worker left ---------------------------------------------------------------
def test_sizes_that_do_not_split_the_heads_are_refused_before_any_worker_starts():
    LLM = load_engine(TP).LLM
    before = child_processes()
    with pytest.raises(ValueError, match="tensor_parallel_size=2 .*9 heads and 3 KV heads"):
        LLM("smollm2-135m", device="cpu", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="tensor_parallel_size=3 .*4 heads and 2 KV heads"):
        LLM("random:tiny-llama", device="cpu", tensor_parallel_size=3)
    for bad in (0, -1, 2.0, True, "2"):
        with pytest.raises(ValueError, match="tensor_parallel_size must be a positive int"):
            LLM("random:tiny-llama", device="cpu", tensor_parallel_size=bad)
    assert child_processes() == before


def test_a_workers_value_error_is_a_value_error_on_rank_0(tmp_path):
    """A ValueError found on a worker only (here its loader refuses the model's type; rank 0 joins the group and
    builds nothing) reaches rank 0 as a ValueError: parallel.py's WorkerValueError, a WorkerError too, that names the
    worker and ends with the worker's own message."""
    p, worker = parallel(), step_module(TP, "worker")
    folder = edited_model(tmp_path, "random:tiny-llama", lambda c: c.update(model_type="gpt2"))
    options = dict(dtype=torch.float32, attention_backend="torch", kv_cache_dtype="auto", enforce_eager=True,
                   max_num_seqs=4, max_kv_tokens=256, block_size=16, warmup_tokens=64, gpu_memory_utilization=0.9)
    workers, tp = worker.Workers(2, torch.device("cpu"), Path(folder), options), None
    try:
        workers.wait_started()
        tp = p.TensorParallel.connect(0, 2, workers.init_method, torch.device("cpu"), workers.timeout_s)
        with pytest.raises(ValueError, match=r"tensor-parallel worker 1 \(pid \d+\) failed") as caught:
            workers.wait_ready()
    finally:
        workers.shutdown()
        if tp is not None:
            tp.close()
    assert isinstance(caught.value, p.WorkerError)
    assert str(caught.value).splitlines()[-1].startswith("ValueError: model: model_type 'gpt2' is not supported")
    assert child_processes() == set()


@pytest.mark.parametrize("step", lesson_and_newest("tensor_parallel"))
def test_a_checkpoint_every_rank_refuses_is_a_value_error(step, tmp_path):
    """A checkpoint without lm_head.weight whose config does not tie it: every rank's loader raises the same
    ValueError. Rank 0's own reaches the caller, not a WorkerError about the workers."""
    folder = edited_model(tmp_path, "random:tiny-llama", drop="lm_head.weight")
    with pytest.raises(ValueError, match="has no lm_head.weight and tie_word_embeddings is false"):
        load_engine(step).LLM(folder, device="cpu", max_kv_tokens=256, tensor_parallel_size=2)
    assert child_processes() == set()


def test_a_killed_worker_is_an_error_on_rank_0_not_a_hang():
    LLM, p = load_engine(TP).LLM, parallel()
    llm = LLM("random:tiny-llama", device="cpu", max_kv_tokens=4096, tensor_parallel_size=2)
    try:
        assert llm.generate(["hello"], SamplingParams(max_tokens=3))[0].outputs[0].token_ids
        os.kill(llm.workers.pids[0], signal.SIGKILL)  # between steps
        llm.workers.processes[0].join(10)
        with pytest.raises(p.WorkerError, match=r"worker 1 \(pid \d+\) died with exit code -9"):
            llm.generate(["hello"], SamplingParams(max_tokens=3))
        assert not llm.has_unfinished_requests()  # the failed step's requests are dropped, not left queued
        with pytest.raises(p.WorkerError, match="shutdown"):  # and the engine stays stopped, saying what to do
            llm.generate(["hello"], SamplingParams(max_tokens=3))
    finally:
        llm.shutdown()
    assert child_processes() == set()
    # killed in the middle of a step's collectives: the all-reduce's peer is gone
    llm = LLM("random:tiny-llama", device="cpu", max_kv_tokens=16384, tensor_parallel_size=2)
    try:
        killer = threading.Timer(1.0, os.kill, (llm.workers.pids[0], signal.SIGKILL))
        killer.start()
        start = time.monotonic()
        with pytest.raises(p.WorkerError, match="worker 1"):
            llm.generate(["hello"] * 8, SamplingParams(max_tokens=1500, ignore_eos=True))
        assert time.monotonic() - start < p.TIMEOUT_S  # an error, well before the collectives' timeout
        killer.join()
    finally:
        llm.shutdown()
    assert child_processes() == set()


def test_a_step_that_fails_on_rank_0_mid_forward_stops_the_engine():
    """Rank 0 failing inside a forward leaves the workers inside that step's collectives: a later step would pair
    its collectives with theirs. It must raise instead, and shutdown() must still stop the workers."""
    LLM, p = load_engine(TP).LLM, parallel()
    llm = LLM("random:tiny-llama", device="cpu", max_kv_tokens=1024, tensor_parallel_size=2)
    try:
        forward = llm.model.forward

        def broken(*args):
            raise RuntimeError("injected")

        llm.model.forward = broken
        with pytest.raises(RuntimeError, match="injected"):
            llm.generate(["hello"], SamplingParams(max_tokens=3))
        llm.model.forward = forward
        with pytest.raises(p.WorkerError, match="collectives no longer line up"):
            llm.generate(["hello"], SamplingParams(max_tokens=3))
    finally:
        llm.shutdown()
    assert child_processes() == set()


@pytest.mark.parametrize("step", having("tensor_parallel"))
def test_shutdown_frees_the_kv_cache_at_once_and_a_new_engine_builds_after_it(step):
    """shutdown() lets go of the KV cache and the graphs itself: with the garbage collector off, the cache is gone
    when it returns (an engine holds reference cycles, so without this its memory waits for a collection), a
    shut-down engine refuses work with an error that says so, and a second engine builds and runs in the process."""
    import weakref

    LLM, params = load_engine(step).LLM, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    gc.collect()
    gc.disable()
    try:
        llm = LLM("random:tiny-llama", device="cpu", dtype="float32", max_kv_tokens=1024)
        first = llm.generate(["build, shut down, build"], params)[0].outputs[0].token_ids
        cache = weakref.ref(llm.runner.kv_cache)
        held_at_release, release = [], llm.runner.release

        def watched_release():  # on CUDA, release() ends by handing the freed memory back (empty_cache): by then
            release()           # nothing may hold the cache, or its memory stays reserved in this process
            held_at_release.append(cache() is not None)

        llm.runner.release = watched_release
        llm.shutdown()
        assert held_at_release == [False], "release() handed the memory back while the engine still held the KV cache"
        assert cache() is None, "shutdown() returned with the KV cache still held"
        assert llm.runner.graphs is None and llm.model.kv_cache is None
        with pytest.raises(RuntimeError, match="shut down"):
            llm.generate(["after"], params)
        llm.shutdown()  # idempotent
        again = LLM("random:tiny-llama", device="cpu", dtype="float32", max_kv_tokens=1024)
        assert again.generate(["build, shut down, build"], params)[0].outputs[0].token_ids == first
        again.shutdown()
    finally:
        gc.enable()


def test_no_worker_is_left_after_shutdown_or_when_the_engine_is_collected():
    LLM = load_engine(TP).LLM
    llm = LLM("random:tiny-llama", device="cpu", max_kv_tokens=1024, tensor_parallel_size=2)
    pids = llm.workers.pids
    assert child_processes() == set(pids)
    llm.shutdown()
    llm.shutdown()  # idempotent
    assert child_processes() == set() and not any(map(alive, pids))
    llm = LLM("random:tiny-llama", device="cpu", max_kv_tokens=1024, tensor_parallel_size=2)  # the group is free again
    pids = llm.workers.pids
    del llm
    gc.collect()
    assert child_processes() == set() and not any(map(alive, pids))


CHILD = """
import os, signal, sys
sys.path.insert(0, {root!r})
from steps.{step}.engine import LLM
if __name__ == "__main__":
    llm = LLM("random:tiny-llama", device="cpu", max_kv_tokens=1024, tensor_parallel_size=2)
    print("PIDS", *llm.workers.pids, flush=True)
    if sys.argv[1] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)  # no exit handler runs: the workers must notice by themselves
"""


@pytest.mark.parametrize("how", ["exit", "kill"])
def test_no_worker_is_left_when_the_engines_process_ends(how, tmp_path):
    script = tmp_path / "child.py"
    script.write_text(CHILD.format(root=str(ROOT), step=TP))
    out = tmp_path / "out.txt"
    with out.open("w") as f:  # a file, not a pipe: a worker left behind would hold a pipe open, and the wait with it
        subprocess.run([sys.executable, str(script), how], stdout=f, stderr=subprocess.STDOUT, timeout=300)
    text = out.read_text()
    pids = [int(x) for line in text.splitlines() if line.startswith("PIDS") for x in line.split()[1:]]
    assert len(pids) == 1, text[-2000:]
    deadline = time.monotonic() + 15  # an orphaned worker's pipe closes: its recv() ends
    while any(map(alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(map(alive, pids))


@pytest.mark.slow
def test_run_py_with_a_tensor_parallel_demo_engine_runs_to_its_end():
    """`run.py --tensor-parallel-size N`: the demo engine itself is split, and the lesson's comparison of sizes builds
    its own tp=N engine after it (one tensor-parallel group per process: the demo's is shut down first, and started
    again for the comparison with step21)."""
    proc = subprocess.run([sys.executable, f"steps/{TP}/run.py", "--model", "random:tiny-llama", "--device", "cpu",
                           "--tensor-parallel-size", "2", "--max-tokens", "8", "--lesson-tokens", "9"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600, env=shell_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "tensor parallel: 2 ranks (gloo)" in proc.stdout and "same as tp=1" in proc.stdout
    assert "The outputs are equal, token for token" in proc.stdout  # step21 against the tp=2 demo engine
    assert child_processes() == set()

# ---- the GPU --------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run on the GPU machine)")
def test_tp1_on_the_gpu_equals_step21():
    """One GPU: no worker, no collective, the same kernels and graphs: step21's tokens and logprobs exactly."""
    prompts = ["The capital of France is", "def fibonacci(n):", "Tensor parallelism splits", "Hello"]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, logprobs=1)
    outs = []
    for step in (BEFORE, TP):
        llm = load_engine(step).LLM("random:qwen3-0.6b", device="cuda", max_kv_tokens=8192)
        outs.append(llm.generate(prompts, params))
        if step == TP:
            assert llm.tp.size == 1 and llm.workers is None and llm.stats["graph_replays"] > 0
            assert "tensor parallel: off" in llm.backend
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    for a, b in zip(*outs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs
    if torch.cuda.device_count() == 1:  # two ranks need two GPUs: refused by name before a process starts
        with pytest.raises(ValueError, match="tensor_parallel_size=2 needs 2 GPUs .*this machine has 1"):
            load_engine(TP).LLM("random:qwen3-0.6b", device="cuda", tensor_parallel_size=2)
