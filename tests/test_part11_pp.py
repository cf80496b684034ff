"""step34: pipeline parallelism. The layers cut into stages (contiguous ranges), each rank holding its stage's layers
and their KV cache, the residual stream sent stage to stage and the tokens back to rank 0, up to pp batches in
flight; every process on this machine, joined by gloo: every test here runs in CI.

- pp=2, pp=3 (5 layers: an uneven split) and tp=2 x pp=2 (4 processes) give pp=1's greedy tokens and logprobs on
  tiny Llama, Qwen3, Qwen3-MoE and DeepSeek, and seeded sampling's tokens, batched, chunked, preempted and with prefix
  hits, while batches overlap (the counters next to the equal outputs).
- The batch queue: a stage-0 launch of batch k + 1 before batch k's tokens are read, never more than pp batches in
  flight, no request in two of them; with async_scheduling off, one at a time.
- Each rank's KV cache holds its layers' share of the bytes, and the stream it sends is a hidden state per token.
- The split, the layout and the options refused with several stages, before any process starts.
- torchrun: two "nodes" on this machine (--nnodes 2 --nproc-per-node 1, rendezvous on 127.0.0.1) run run.py to the
  same tokens as one stage, with the mapping printed.
- A stage that dies is an error on rank 0, not a hang, and no worker is left after shutdown.
"""
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from helpers import (TP_LOGPROB_ATOL_FP32, alive, child_processes, children_of, compare_completions, load_engine,
                     shell_env, start_server, step_module)
from registry import introducing
from shared import SamplingParams

PP = introducing("pipeline_parallel")
ROOT = Path(__file__).resolve().parents[1]
OPTIONS = dict(device="cpu", dtype="float32")


def parallel():
    return step_module(PP, "parallel")


def prompts_with_a_shared_prefix(num: int) -> list[list[int]]:
    """Prompts that share a 32-token prefix (two blocks of 16: prefix-cache hits), each with its own tail."""
    g = torch.Generator().manual_seed(34)
    prefix = torch.randint(0, 49152, (32,), generator=g).tolist()
    return [prefix + torch.randint(0, 49152, (3 + 5 * i,), generator=g).tolist() for i in range(num)]


# ---- the engine: the same tokens as one stage ---------------------------------------------------------------
CASES = [
    ("random:tiny-llama-5-layers", dict(pipeline_parallel_size=3)),  # 2, 2, 1 layers
    ("random:tiny-qwen3", dict(pipeline_parallel_size=2)),
    ("random:tiny-qwen3-moe", dict(pipeline_parallel_size=2)),  # 2, 1: the sparse layers on both stages
    ("random:tiny-deepseek-v3", dict(pipeline_parallel_size=2)),  # latent attention's cache rows on each stage
    ("random:tiny-qwen3", dict(pipeline_parallel_size=2, tensor_parallel_size=2)),  # 4 processes
]


@pytest.mark.parametrize("model,options", CASES, ids=[f"{m.split(':')[1]}-{'x'.join(map(str, o.values()))}"
                                                      for m, o in CASES])
def test_pp_equals_one_stage_batched_chunked_preempted_and_cached(model, options):
    """Six prompts with a shared prefix, in a token budget of 24 (every prompt in chunks), two requests a batch, in a
    pool of 10 blocks (the newest request is preempted): greedy tokens equal one stage's and logprobs within the
    collectives' bound, seeded sampled tokens equal; prefix hits, chunks, preemptions and two batches in flight
    counted on the pipelined engine."""
    LLM = load_engine(PP).LLM
    common = dict(OPTIONS, max_kv_tokens=160, max_num_batched_tokens=24, max_num_seqs=2, block_size=16,
                  async_scheduling=True)
    prompts = prompts_with_a_shared_prefix(6)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    seeded = SamplingParams(temperature=0.8, seed=7, max_tokens=8, ignore_eos=True)

    def run(llm):
        return (llm.generate(prompts[:1], greedy) + llm.generate(prompts[1:], greedy), llm.generate(prompts, seeded))

    one = LLM(model, **common)
    want, want_seeded = run(one)
    one.shutdown()
    llm = LLM(model, **common, **options)
    try:
        got, got_seeded = run(llm)
        stats = llm.stats
        assert stats["prefill_chunks"] > len(prompts) and llm.block_manager.stats["hits"] > 0
        assert llm.scheduler.num_preemptions > 0
        assert stats["most_batches_in_flight"] == options["pipeline_parallel_size"]
        for a, b in zip(want, got):
            compare_completions(a.outputs[0], b.outputs[0], TP_LOGPROB_ATOL_FP32, label=model)
        assert [o.outputs[0].token_ids for o in want_seeded] == [o.outputs[0].token_ids for o in got_seeded]
    finally:
        llm.shutdown()
    assert child_processes() == set()


# ---- the batch queue ------------------------------------------------------------------------------------------
def in_flight_walk(launches: list[tuple]) -> tuple[int, int]:
    """Replay the core's record of launches and reads: each launch finds fewer than pp batches in flight and shares
    no request with them, each read is of the oldest. -> (the most in flight at once, the launches made while the
    batch before was still unread)."""
    flight: dict[int, set] = {}
    most = overlapped = 0
    for kind, number, ids in launches:
        if kind == "launch":
            for other in flight.values():
                assert not other & set(ids), f"batch {number} shares requests {other & set(ids)} with one in flight"
            overlapped += (number - 1) in flight
            flight[number] = set(ids)
            most = max(most, len(flight))
        else:
            assert number == min(flight), f"batch {number} read before the older {min(flight)}"
            del flight[number]
    return most, overlapped


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_batches_overlap_up_to_pp_and_no_request_is_in_two(async_scheduling):
    """Eight requests, two a batch, over 2 stages: with async_scheduling stage 0 launches batch k + 1 before batch k's
    tokens come back from stage 1, never more than 2 batches are in flight and no request is in two; without it, one
    batch at a time (the bubble the lesson counts)."""
    LLM = load_engine(PP).LLM
    llm = LLM("random:tiny-qwen3", **OPTIONS, max_kv_tokens=4096, max_num_seqs=2, pipeline_parallel_size=2,
              async_scheduling=async_scheduling)
    try:
        prompts = prompts_with_a_shared_prefix(8)
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
        assert all(len(o.outputs[0].token_ids) == 6 for o in outs)
        most, overlapped = in_flight_walk(llm.core.launches)
        assert llm.core.depth == (2 if async_scheduling else 1)
        if async_scheduling:
            assert most == 2 and overlapped > 0
        else:
            assert most == 1 and overlapped == 0
        assert llm.stats["most_batches_in_flight"] == most
        # every stage ran every batch, in order: the worker's forwards are rank 0's launches
        report, = llm.core.workers.stages()
        assert report["forwards"] == llm.stats["batches_launched"] == len(report["timeline"])
    finally:
        llm.shutdown()


def test_each_rank_holds_its_layers_kv_and_sends_a_hidden_state_per_token():
    """tiny-llama-5-layers over 3 stages (2, 2, 1 layers): each rank's KV cache is its layers' share of one stage's
    bytes, and the streams sent across each boundary are hidden_size floats per token computed."""
    LLM = load_engine(PP).LLM
    one = LLM("random:tiny-llama-5-layers", **OPTIONS, max_kv_tokens=1024)
    whole = one.core.runner.kv_cache.nbytes
    one.shutdown()
    llm = LLM("random:tiny-llama-5-layers", **OPTIONS, max_kv_tokens=1024, pipeline_parallel_size=3)
    try:
        out = llm.generate(prompts_with_a_shared_prefix(2), SamplingParams(temperature=0, max_tokens=4))
        reports = [dict(stage=0, layers=(0, 2), kv_bytes=llm.core.runner.kv_cache.nbytes,
                        bytes_sent=llm.core.pipe.bytes_sent, bytes_received=0)] + llm.core.workers.stages()
        assert [r["layers"] for r in reports] == [(0, 2), (2, 4), (4, 5)]
        assert [r["kv_bytes"] for r in reports] == [whole * 2 // 5, whole * 2 // 5, whole // 5]
        # every token computed crosses each boundary once, as hidden_size float32s
        tokens = sum(len(o.prompt_token_ids) for o in out) + sum(len(o.outputs[0].token_ids) - 1 for o in out)
        per_token = llm.model.config.hidden_size * 4
        assert [r["bytes_sent"] for r in reports] == [tokens * per_token, tokens * per_token, 0]
        assert [r["bytes_received"] for r in reports] == [0, tokens * per_token, tokens * per_token]
        assert "rank 2 = stage 2 tp 0 (layers 4-4)" in llm.backend
    finally:
        llm.shutdown()


# ---- the split, the layout, the refusals (no process started) -----------------------------------------------
def test_the_layer_split_and_the_layout():
    p = parallel()
    assert p.stage_layers(5, 3) == [range(0, 2), range(2, 4), range(4, 5)]
    assert p.stage_layers(28, 3) == [range(0, 9), range(9, 19), range(19, 28)]  # the extra layer not on the ends
    assert p.stage_layers(4, 2) == [range(0, 2), range(2, 4)]
    assert p.stage_layers(5, 3, "1,1,3") == p.stage_layers(5, 3, [1, 1, 3]) == [range(0, 1), range(1, 2), range(2, 5)]
    for bad in ("2,2", "1,1,2", "0,2,3", "a,b,c"):
        with pytest.raises(ValueError, match="pp_layer_partition"):
            p.stage_layers(5, 3, bad)
    layout = p.Layout(2, 2, 4)
    assert [layout.place(r) for r in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert layout.describe().startswith("rank 0 = stage 0 tp 0 (layers 0-1); rank 1 = stage 0 tp 1 (layers 0-1); "
                                        "rank 2 = stage 1 tp 0 (layers 2-3)")
    assert p.idle_shares([[(0.0, 1.0), (2.0, 3.0)], [(1.0, 2.0), (3.0, 4.0)]]) == [0.5, 0.5]


@pytest.mark.parametrize("options,expected", [
    (dict(pipeline_parallel_size=0), "pipeline_parallel_size must be a positive int"),
    (dict(pipeline_parallel_size=3), "the model has 2 layers"),
    (dict(pipeline_parallel_size=2, pp_layer_partition="2,1"), "pp_layer_partition='2,1'"),
    (dict(pipeline_parallel_size=2, speculative_config={"method": "ngram", "num_speculative_tokens": 2}),
     "speculative_config=.* with pipeline_parallel_size=2"),
    (dict(pipeline_parallel_size=2, kv_offloading_size=0.01), "kv_offloading_size=0.01 with pipeline_parallel_size=2"),
    (dict(pipeline_parallel_size=2, distributed_executor_backend="ray"), "distributed_executor_backend"),
])
def test_bad_pipeline_options_are_refused_before_any_process_starts(options, expected):
    before = child_processes()
    with pytest.raises(ValueError, match=expected):
        load_engine(PP).LLM("random:tiny-llama", **OPTIONS, **options)
    assert child_processes() == before


# ---- torchrun: two nodes on one machine ------------------------------------------------------------------------
def test_two_torchrun_nodes_give_one_stages_tokens():
    """`torchrun --nnodes 2 --nproc-per-node 1 --node-rank R --master-addr 127.0.0.1 steps/step34/run.py`, as two
    processes: node 0's rank 0 is the engine, node 1's rank 1 serves stage 1; the engine's line names the launcher
    and the mapping, the run's tokens equal step33's (one stage: before_after's check), and both nodes exit 0."""
    port = parallel().free_port()
    args = ["--model", "random:tiny-llama", "--device", "cpu", "--max-tokens", "4", "--lesson-tokens", "4",
            "--requests", "2"]
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                               "--node-rank", str(rank), "--master-addr", "127.0.0.1", "--master-port", str(port),
                               f"steps/{PP}/run.py", *args], cwd=ROOT, env=shell_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    try:
        results = [node.communicate(timeout=400) for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    for node, (out, err) in zip(nodes, results):
        assert node.returncode == 0, err[-3000:]
    out = results[0][0]
    assert "started by external_launcher" in out
    assert "[rank 0 = stage 0 tp 0 (layers 0-0); rank 1 = stage 1 tp 0 (layers 1-1)]" in out
    assert "The outputs are equal, token for token" in out, out[-3000:]
    assert re.search(r"\d+ batches; [1-9]\d* launched on stage 0 while the batch before", out), out[-3000:]


# ---- a stage that dies ---------------------------------------------------------------------------------------------
def test_a_killed_stage_is_an_error_on_rank_0_not_a_hang():
    """Three stages; stage 1's worker killed in the middle of a run: rank 0 raises WorkerError naming the worker well
    before the collectives' timeout, the engine stays stopped, and shutdown leaves no worker (stage 2's, whose peer
    went away, included)."""
    LLM, p = load_engine(PP).LLM, parallel()
    llm = LLM("random:tiny-llama-5-layers", **OPTIONS, max_kv_tokens=16384, pipeline_parallel_size=3,
              async_scheduling=True, max_num_seqs=2)
    try:
        assert llm.generate(["hello"], SamplingParams(max_tokens=3))[0].outputs[0].token_ids
        killer = threading.Timer(1.0, os.kill, (llm.workers.pids[0], signal.SIGKILL))
        killer.start()
        start = time.monotonic()
        with pytest.raises(p.WorkerError, match=r"worker 1 \(stage 1"):
            llm.generate(["hello"] * 8, SamplingParams(max_tokens=1500, ignore_eos=True))
        assert time.monotonic() - start < p.TIMEOUT_S
        killer.join()
        with pytest.raises(p.WorkerError, match="shutdown"):
            llm.generate(["hello"], SamplingParams(max_tokens=3))
    finally:
        llm.shutdown()
    assert child_processes() == set()


# ---- the core process and the server -----------------------------------------------------------------------------
def test_the_server_with_two_stages_answers_with_its_key_and_a_dead_stage_is_a_503():
    """serve.py as a command with --pipeline-parallel-size 2 and --api-key: the engine core's process runs the
    stages' rank 0 and spawns stage 1; a request without the key is refused, one with it gets one stage's greedy
    text; then stage 1's worker is killed: the core dies (no step runs without a stage), the request it died under
    says which worker, every later one is a 503, /health too, and SIGINT ends the server with no process of it left."""
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    want = load_engine(PP).LLM("random:tiny-llama", **OPTIONS).generate(
        ["hello"], SamplingParams(temperature=0, max_tokens=4))[0].outputs[0].text
    proc, base = start_server(PP, "--model", "random:tiny-llama", "--device", "cpu", "--pipeline-parallel-size", "2",
                              "--api-key", "sekret", env=shell_env())
    key = {"Authorization": "Bearer sekret"}
    try:
        body = {"model": "random:tiny-llama", "prompt": "hello", "max_tokens": 4, "temperature": 0}
        assert httpx.post(f"{base}/v1/completions", json=body, timeout=60).status_code == 401
        r = httpx.post(f"{base}/v1/completions", json=body, headers=key, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want, r.text
        core = httpx.get(f"{base}/stats", headers=key, timeout=10).json()["core_pid"]
        workers = children_of(core)
        assert len(workers) == 1, workers  # stage 1's worker, the core's child
        os.kill(workers.pop(), signal.SIGKILL)
        r = httpx.post(f"{base}/v1/completions", json=body, headers=key, timeout=60)
        # the request the core died under names the stage; every later one is a 503
        assert r.status_code in (500, 503) and "worker 1 (stage 1, tp rank 0" in r.text, r.text
        assert httpx.post(f"{base}/v1/completions", json=body, headers=key, timeout=60).status_code == 503
        assert httpx.get(f"{base}/health", timeout=10).status_code == 503
        tree = children_of(proc.pid)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
        deadline = time.monotonic() + 15  # a child sees its parent gone and exits a moment after it
        while any(map(alive, tree)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [pid for pid in tree if alive(pid)]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()



@pytest.mark.parametrize("options", [dict(quantization="int4"), dict(quantization="fp8"),
                                     dict(kv_cache_dtype="int8"), dict(kv_cache_dtype="fp8")],
                         ids=["int4-weights", "fp8-weights", "int8-cache", "fp8-cache"])
def test_quantized_weights_and_caches_run_in_stages(options):
    """4-bit and FP8 weights, int8 and FP8 caches: two stages give one stage's greedy tokens under the same option
    (each stage quantizes its own layers; an int8 cache's scales and an FP8 cache's per-layer scales are its layers')."""
    LLM = load_engine(PP).LLM
    prompts = prompts_with_a_shared_prefix(3)
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    one = LLM("random:tiny-llama-5-layers", **OPTIONS, max_kv_tokens=1024, **options)
    want = [o.outputs[0].token_ids for o in one.generate(prompts, sp)]
    whole = one.core.runner.kv_cache.nbytes
    one.shutdown()
    llm = LLM("random:tiny-llama-5-layers", **OPTIONS, max_kv_tokens=1024, pipeline_parallel_size=2, **options)
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, sp)] == want
        stage1, = llm.core.workers.stages()  # 3 + 2 layers: each stage's cache (with its scales) is its share
        assert (llm.core.runner.kv_cache.nbytes, stage1["kv_bytes"]) == (whole * 3 // 5, whole * 2 // 5)
    finally:
        llm.shutdown()


# ---- on several GPUs (the multi-GPU run) ------------------------------------------------------------------------
GPU_LAYOUTS = [dict(pipeline_parallel_size=2), dict(tensor_parallel_size=2),
               dict(tensor_parallel_size=2, pipeline_parallel_size=2)]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices (run on a machine with several)")
@pytest.mark.parametrize("options", GPU_LAYOUTS, ids=["pp2", "tp2", "tp2xpp2"])
@pytest.mark.parametrize("model", ["random:qwen3-0.6b", "random:tiny-qwen3-moe", "random:tiny-deepseek-v3"])
def test_on_gpus_the_split_gives_one_gpus_tokens(model, options):
    """NCCL between the GPUs: pp=2, tp=2 and tp=2 x pp=2 (where four GPUs) give one GPU's tokens under the bf16 rule
    the other GPU tests use (the first divergence a near-tie; logprobs close on average), and no worker is left."""
    from helpers import BF16_LOGPROB_MAX_ATOL, BF16_LOGPROB_MEAN_ATOL

    world = options.get("tensor_parallel_size", 1) * options.get("pipeline_parallel_size", 1)
    if world > torch.cuda.device_count():
        pytest.skip(f"needs {world} GPUs")
    if "deepseek" in model and options.get("tensor_parallel_size", 1) > 1:
        pytest.skip("latent attention runs on one tensor-parallel rank in this step (refused by name)")
    LLM = load_engine(PP).LLM
    prompts = prompts_with_a_shared_prefix(8)
    sp = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=5)
    one = LLM(model, device="cuda", max_kv_tokens=16384)
    want = one.generate(prompts, sp)
    one.shutdown()
    llm = LLM(model, device="cuda", max_kv_tokens=16384, async_scheduling=True, max_num_seqs=4, **options)
    try:
        got = llm.generate(prompts, sp)
        if options.get("pipeline_parallel_size", 1) > 1:
            assert llm.stats["most_batches_in_flight"] == 2
        diffs = []
        for a, b in zip(want, got):  # the vLLM rule at the first divergence, and every logprob before it
            compare_completions(a.outputs[0], b.outputs[0], BF16_LOGPROB_MAX_ATOL, exact=False, label=model)
            for ta, tb, la, lb in zip(a.outputs[0].token_ids, b.outputs[0].token_ids, a.outputs[0].logprobs,
                                      b.outputs[0].logprobs):
                if ta != tb:
                    break
                diffs.append(abs(la[ta] - lb[tb]))
        assert sum(diffs) / len(diffs) <= BF16_LOGPROB_MEAN_ATOL
    finally:
        llm.shutdown()
    assert child_processes() == set()
