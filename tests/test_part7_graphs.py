"""step21: CUDA graphs. The decode forward is recorded once per batch bucket and replayed; the batch is padded to its
bucket, padding rows write to a scratch block; `enforce_eager` turns graphs off; a CPU runs eagerly.

On the CPU: the buckets and the padding, unit by unit (what a fill writes into the device buffers, its copies
counted as they run); the eager engine against step20 (the same tokens, the same draws for seeded sampling); and the
static-buffer runner itself, which the engine drives through prepare() and launch() eagerly where no graph can be
captured: the same fill-and-forward code a graph records, padded batches included, against the plain engine.
On the GPU (marked gpu): replayed graphs against the same padded forward run eagerly (bit for bit), against
enforce_eager=True (the vLLM rule: padding changes the matmuls' shapes), one wait for the GPU per step.
"""
import random

import pytest
import torch

from helpers import STEP_LOGPROB_ATOL_FP32, compare_completions, edited_model, load_engine, step_module
from registry import introducing, last_before
from shared import SamplingParams

GRAPHS = introducing("cuda_graphs")
BEFORE = last_before("cuda_graphs")
ON_GPU = torch.cuda.is_available()


def graphs_module():
    return step_module(GRAPHS, "cuda_graphs")


class BufferWrites:
    """Records, while active, every torch operator that writes into the device buffers of a StaticDecodeInputs
    (longs, ints): (operator, the buffer written, the staging buffer read or None). Counted by a TorchDispatchMode
    as the operators run, not by the code's own counter."""

    def __init__(self, inputs):
        storage = lambda t: t.untyped_storage().data_ptr()  # noqa: E731  (views share their base's storage)
        self.devices = {storage(inputs.longs): "longs", storage(inputs.ints): "ints"}
        self.staging = {storage(inputs.host_longs): "host_longs", storage(inputs.host_ints): "host_ints"}
        self.writes, self._storage = [], storage

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        recorder = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                schema = func._schema.arguments
                values = list(args) + [kwargs.get(a.name) for a in schema[len(args):]]
                written = [recorder.devices.get(recorder._storage(v)) for a, v in zip(schema, values)
                           if a.alias_info is not None and a.alias_info.is_write and isinstance(v, torch.Tensor)]
                read = [recorder.staging.get(recorder._storage(v)) for v in values[1:] if isinstance(v, torch.Tensor)]
                for buffer in filter(None, written):
                    recorder.writes.append((str(func), buffer, next(filter(None, read), None)))
                return func(*args, **kwargs)

        self._mode = Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)
        return False


# What one fill must write into the device buffers: one copy of each, from its pinned staging copy.
TWO_COPIES = [("aten.copy_.default", "longs", "host_longs"), ("aten.copy_.default", "ints", "host_ints")]


class FakeSeq:
    """What the static buffers read of a decoding sequence: its tokens, how many have K/V, its block table (through
    its row of the runner's BlockTables, keyed by request_id)."""

    def __init__(self, num_tokens, block_table, first_token=100, request_id="0"):
        self.token_ids = list(range(first_token, first_token + num_tokens))
        self.num_computed_tokens = num_tokens - 1  # the newest token has no K/V yet: a decode
        self.block_table = list(block_table)
        self.request_id = request_id


def rows_of(tables, seqs):
    """The sequences' tables written into their rows of a BlockTables (as the runner does before a fill)."""
    return tables.write(tables.changes([(seq, 1) for seq in seqs]))


def test_graph_batch_sizes_and_buckets():
    g = graphs_module()
    assert g.graph_batch_sizes(1) == [1]
    assert g.graph_batch_sizes(3) == [1, 2, 3]
    assert g.graph_batch_sizes(16) == [1, 2, 4, 8, 16]
    assert g.graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]  # max_num_seqs itself is always a bucket
    assert g.graph_batch_sizes(256) == [1, 2, 4] + list(range(8, 257, 8))
    assert g.graph_batch_sizes(300)[-4:] == [256, 272, 288, 300]  # every 16 past 256
    sizes = g.graph_batch_sizes(64)
    assert [g.padded_size(n, sizes) for n in (1, 2, 3, 4, 5, 8, 9, 17, 64)] == [1, 2, 4, 4, 8, 8, 16, 24, 64]
    for bad in (0, 65):
        with pytest.raises(ValueError, match=f"a decode batch of {bad} rows has no graph"):
            g.padded_size(bad, sizes)
    for bad in (0, 2.0, True):
        with pytest.raises(ValueError, match="max_num_seqs must be a positive int"):
            g.graph_batch_sizes(bad)


def test_fill_writes_the_rows_and_pads_to_the_scratch_block():
    """Three decodes in a bucket of 4: rows 0-2 are theirs, row 3 is padding (token 0 at position 0, its K/V to the
    scratch block's first slot, a context of that one slot). The block tables and slots come from the sequences'
    persistent rows, which need not be rows 0-2. A second, narrower fill rewrites what it uses."""
    g = graphs_module()
    tables = step_module(GRAPHS, "model_runner").BlockTables(8, 8, torch.device("cpu"))
    inputs = g.StaticDecodeInputs(max_seqs=8, max_blocks=6, device=torch.device("cpu"))
    tables.write(tables.changes([(FakeSeq(1, [8], request_id="x"), 1)]))  # holds row 0: the others get 1, 2, 3
    seqs = [FakeSeq(5, [7, 2], request_id="a"), FakeSeq(9, [1, 4, 3], request_id="b"),
            FakeSeq(1, [5], request_id="c")]  # block_size 4: slots of positions 4, 8, 0
    rows = rows_of(tables, seqs)
    assert rows == [1, 2, 3]
    with BufferWrites(inputs) as first:
        inputs.fill(seqs, tables, rows, 4, block_size=4, scratch_block=9)
    assert inputs.input_ids[:4].tolist() == [104, 108, 100, 0]
    assert inputs.positions[:4].tolist() == [4, 8, 0, 0]
    assert inputs.slot_mapping[:4].tolist() == [2 * 4 + 0, 3 * 4 + 0, 5 * 4 + 0, 9 * 4]
    assert inputs.seq_lens[:4].tolist() == [5, 9, 1, 1]
    assert inputs.block_tables[0, :2].tolist() == [7, 2] and inputs.block_tables[1, :3].tolist() == [1, 4, 3]
    assert inputs.block_tables[2, 0] == 5 and inputs.block_tables[3, 0] == 9
    late = FakeSeq(2, [6], request_id="d")
    with BufferWrites(inputs) as second:
        inputs.fill([late], tables, rows_of(tables, [late]), 2, block_size=4, scratch_block=9)
    assert first.writes == second.writes == TWO_COPIES  # two host-to-device copies per fill, whatever the batch
    assert inputs.input_ids[:2].tolist() == [101, 0] and inputs.slot_mapping[:2].tolist() == [6 * 4 + 1, 36]
    assert inputs.block_tables[:2, 0].tolist() == [6, 9] and inputs.seq_lens[:2].tolist() == [2, 1]
    with pytest.raises(ValueError, match="fill: 3 sequences in a batch of 2"):
        inputs.fill(seqs, tables, rows, 2, block_size=4, scratch_block=9)
    wide = FakeSeq(30, range(8), request_id="e")
    with pytest.raises(ValueError, match="wider than the graphs' 6"):
        inputs.fill([wide], tables, rows_of(tables, [wide]), 1, block_size=4, scratch_block=9)


def mixed_requests(seed=21, n=6, max_tokens=(4, 10, 10, 13, 12, 19)):
    """Prompts of different lengths and answers of different lengths (max_tokens): the batch shrinks as requests
    finish, so the decode steps meet several buckets and padded rows. Two are seeded samples (the sampler runs on the
    device)."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, 1000) for _ in range(length)] for length in (3, 17, 40, 9, 28, 5)[:n]]
    params = [SamplingParams(temperature=0, max_tokens=max_tokens[i], ignore_eos=True, logprobs=2) for i in range(n)]
    params[1] = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=7, max_tokens=max_tokens[1],
                               ignore_eos=True, logprobs=2)
    params[4] = SamplingParams(temperature=1.2, min_p=0.05, seed=3, max_tokens=max_tokens[4], ignore_eos=True,
                               logprobs=0)
    return prompts, params


@pytest.mark.parametrize("model", ["random:tiny-llama", "random:tiny-qwen3"])
def test_eager_engine_equals_step20(model):
    """On the CPU step21 runs eagerly and says so; its tokens, logprobs and seeded draws are step20's."""
    prompts, params = mixed_requests()
    options = dict(device="cpu", max_num_batched_tokens=16, max_num_seqs=8)
    expected = load_engine(BEFORE).LLM(model, **options).generate(prompts, params)
    llm = load_engine(GRAPHS).LLM(model, **options)
    got = llm.generate(prompts, params)
    for a, b in zip(got, expected):
        compare_completions(a.outputs[0], b.outputs[0], STEP_LOGPROB_ATOL_FP32)
        assert a.outputs[0].cumulative_logprob == pytest.approx(b.outputs[0].cumulative_logprob, abs=1e-3)
    assert llm.cuda_graphs["enabled"] is False and "CUDA graphs need a CUDA GPU" in llm.cuda_graphs["reason"]
    assert "CUDA graphs: off, eager" in llm.backend
    assert llm.stats["graph_replays"] == 0 and llm.stats["eager_forwards"] == llm.stats["forwards"] > 0
    assert llm.runner.graphs is None


def attach_eager_graphs(llm):
    """The engine's static-buffer runner, built but never captured: every decode step goes through its fill and
    its padded forward, run eagerly (what a CPU can do of a graph). runner.fills: what each fill wrote into the
    device buffers (BufferWrites); runner.buckets: the bucket of each step."""
    runner, block_size = llm.runner, llm.block_manager.block_size
    runner.graphs = graphs_module().DecodeGraphs(llm.model, llm.device, runner.max_num_seqs, block_size,
                                                 runner.scratch_block, runner.max_table_blocks(block_size),
                                                 llm.model.config.max_position_embeddings)
    graphs, inputs, fill, prepare = runner.graphs, runner.graphs.inputs, runner.graphs.inputs.fill, runner.graphs.prepare
    graphs.fills, graphs.buckets = [], []

    def recorded_fill(*args, **kwargs):
        with BufferWrites(inputs) as recorded:
            fill(*args, **kwargs)
        graphs.fills.append(recorded.writes)

    def recorded_prepare(*args, **kwargs):
        graphs.buckets.append(prepare(*args, **kwargs))
        return graphs.buckets[-1]

    inputs.fill, graphs.prepare = recorded_fill, recorded_prepare
    return graphs


# Qwen3's case checks all that Llama's does (the same buckets, fills and splits), and preemption besides: Llama's
# runs in make test, not in make test-fast (the runner's buffers do not depend on the model family).
@pytest.mark.parametrize("model,kv_tokens", [pytest.param("random:tiny-llama", None, marks=pytest.mark.slow),
                                             ("random:tiny-qwen3", 144)])
def test_static_buffer_runner_equals_the_engine(model, kv_tokens, tmp_path):
    """The fill-and-forward code a graph records, run eagerly in Triton's interpreter: padded to buckets (requests
    finishing one by one: batches 5 .. 1 in buckets 8, 4, 2, 1), two requests added once the first five are done
    (the buffers refilled for new sequences), and (Qwen3, a pool of 144 tokens) preemption. The outputs are the plain
    engine's.

    The answers are as short as still gives those (5 .. 10 tokens: one preemption in Qwen3's pool), and the model's
    length is 512 tokens, not 2048: the graphs' flash decoding then splits each context 2 ways, not 8 (the split
    count is chosen for the model's length), and the interpreter runs a quarter of the programs. Every context
    here is one tile of 64 tokens, so either way each decode merges one full split with empty ones."""
    prompts, params = mixed_requests(max_tokens=(6, 8, 10, 10, 10, 5))
    model = edited_model(tmp_path, model, lambda config: config.update(max_position_embeddings=512))
    options = dict(device="cpu", max_num_batched_tokens=64, max_num_seqs=8, attention_backend="triton",
                   max_kv_tokens=kv_tokens)
    results = {}
    for static in (False, True):
        llm = load_engine(GRAPHS).LLM(model, **options)
        runner = attach_eager_graphs(llm) if static else None
        outs = llm.generate(prompts[:5], params[:5])
        late = llm.add_request(prompts[5], params[5])  # two more, queued after the first batch has finished
        llm.add_request(prompts[0], params[0])
        while llm.has_unfinished_requests():
            outs += llm.step()
        results[static] = (sorted(outs, key=lambda o: int(o.request_id)), llm, runner)
    (plain, _, _), (padded, llm, runner) = results[False], results[True]
    assert [o.request_id for o in padded] == [o.request_id for o in plain] and late in [o.request_id for o in padded]
    for a, b in zip(padded, plain):
        compare_completions(a.outputs[0], b.outputs[0], STEP_LOGPROB_ATOL_FP32, label=f"request {a.request_id}")
    assert runner.eager_runs > 0 and runner.replays == 0  # the static path ran, with no graph (a CPU)
    assert llm.stats["padded_rows"] > 0  # some batches were padded up to their bucket
    assert set(runner.buckets) == {1, 2, 4, 8}  # every bucket of max_num_seqs=8
    assert len(runner.fills) == runner.eager_runs and all(writes == TWO_COPIES for writes in runner.fills)
    assert set(runner.num_splits.values()) == {2}  # split decoding, as on a GPU for a short batch
    if kv_tokens is not None:
        assert llm.scheduler.num_preemptions > 0


def test_padding_rows_write_only_the_scratch_block():
    """A decode step of 3 in a bucket of 4: the cache changes at the 3 real rows' slots and in the scratch block
    (where the padding row wrote), nowhere else."""
    llm = load_engine(GRAPHS).LLM("random:tiny-llama", device="cpu", attention_backend="triton", max_num_seqs=4,
                                  max_kv_tokens=256)
    runner = attach_eager_graphs(llm)
    llm.runner.kv_cache.data.zero_()  # the cache is allocated uninitialised: NaN there would never compare equal
    for prompt in ([5, 6, 7], [8, 9], [10, 11, 12, 13, 14]):
        llm.add_request(prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    llm.step()  # the three prompts, eagerly: each gets its first token
    seqs = list(llm.scheduler.running)
    block_size = llm.block_manager.block_size
    real = {seq.block_table[(seq.num_tokens - 1) // block_size] * block_size + (seq.num_tokens - 1) % block_size
            for seq in seqs}  # where each decode's K/V go: its newest token's slot
    cache = llm.runner.kv_cache.data
    before = cache.clone()
    llm.step()  # three decodes, padded to 4
    assert runner.eager_runs == 1 and llm.stats["padded_rows"] == 1
    changed = (cache != before).flatten(4).any(-1).any(0).any(0)  # [blocks, block_size]: a slot changed
    slots = set(changed.flatten().nonzero().flatten().tolist())
    scratch = set(range(runner.scratch_block * block_size, (runner.scratch_block + 1) * block_size))
    assert real <= slots and slots & scratch, (sorted(slots), sorted(real))
    assert slots <= real | scratch, f"padding wrote outside the scratch block: {sorted(slots - real - scratch)}"


# ---- on the GPU ---------------------------------------------------------------------------------------------

def gpu_requests(n=20, seed=4):
    """20 requests of 5..300 prompt tokens and 3..40 new tokens: the batch shrinks from 20 through every bucket."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, 5000) for _ in range(rng.randrange(5, 300))] for _ in range(n)]
    params = [SamplingParams(temperature=0, max_tokens=rng.randrange(3, 40), ignore_eos=True, logprobs=5)
              for _ in range(n)]
    return prompts, params


def run_with_changes(llm, prompts, params):
    """Most requests at once, two more joining mid-run, one aborted mid-run: the batch changes every few steps."""
    ids = [llm.add_request(p, sp) for p, sp in zip(prompts[:-2], params[:-2])]
    outs, steps = [], 0
    while llm.has_unfinished_requests():
        outs += llm.step()
        steps += 1
        if steps == 5:
            ids += [llm.add_request(p, sp) for p, sp in zip(prompts[-2:], params[-2:])]
        if steps == 8:
            llm.abort_request(ids[3])
    return sorted(outs, key=lambda o: int(o.request_id))


@pytest.mark.gpu
@pytest.mark.parametrize("model", ["random:qwen3-0.6b", "random:smollm2-135m"])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_replayed_graphs_equal_the_same_forward_run_eagerly(model, kv_cache_dtype):
    """bf16 on the H200: an engine that replays its graphs against one whose graphs are dropped (the same static
    buffers, padding and kernels, launched eagerly): token for token, logprob for logprob, while the batch changes
    (finishing, joining, aborted requests) and, in a small pool, with preemption."""
    prompts, params = gpu_requests()
    results = {}
    for replay in (True, False):
        llm = load_engine(GRAPHS).LLM(model, device="cuda", dtype="bfloat16", max_num_seqs=32,
                                      max_kv_tokens=2400, kv_cache_dtype=kv_cache_dtype)
        sizes = graphs_module().graph_batch_sizes(32)  # 1, 2, 4, 8, 16, 24, 32
        assert llm.cuda_graphs["enabled"] and len(llm.runner.graphs.graphs) == len(llm.cuda_graphs["sizes"]) == 7
        assert llm.cuda_graphs["sizes"] == sizes
        if not replay:
            llm.runner.graphs.graphs.clear()  # no graph: launch() runs the recorded forward eagerly
        results[replay] = (run_with_changes(llm, prompts, params), llm)
    (graphed, llm), (eager, _) = results[True], results[False]
    assert len(graphed) == len(eager) == len(prompts) - 1
    for a, b in zip(graphed, eager):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids, f"request {a.request_id}"
        assert a.outputs[0].logprobs == b.outputs[0].logprobs, f"request {a.request_id}"
    assert llm.stats["graph_replays"] == llm.runner.graphs.replays > 10 and llm.stats["padded_rows"] > 0
    assert llm.scheduler.num_preemptions > 0  # 2,400 tokens for 20 requests of up to 340
    assert "CUDA graphs: 7 captured" in llm.backend


@pytest.mark.gpu
@pytest.mark.parametrize("model", ["random:qwen3-0.6b", "random:smollm2-135m"])
def test_graphs_equal_enforce_eager(model):
    """Graphs against enforce_eager=True (step20's path): padding gives the matmuls other shapes, so cuBLAS may
    round differently; in bf16 with random weights a near-tie can then go the other way. The vLLM rule."""
    from helpers import BF16_LOGPROB_MAX_ATOL

    prompts, params = gpu_requests()
    outs, engines = {}, {}
    for eager in (True, False):
        llm = load_engine(GRAPHS).LLM(model, device="cuda", dtype="bfloat16", max_num_seqs=32, enforce_eager=eager,
                                      max_kv_tokens=40000)  # a fixed pool: both engines fit on the GPU at once
        outs[eager], engines[eager] = llm.generate(prompts, params), llm
    identical = 0
    for a, b in zip(outs[False], outs[True]):
        compare_completions(a.outputs[0], b.outputs[0], BF16_LOGPROB_MAX_ATOL, exact=False)
        identical += a.outputs[0].token_ids == b.outputs[0].token_ids
    print(f"{model}: {identical}/{len(prompts)} answers identical to enforce_eager's")
    assert engines[True].stats["graph_replays"] == 0 and engines[True].cuda_graphs["reason"] == "enforce_eager=True"
    assert engines[False].stats["graph_replays"] > 0


@pytest.mark.gpu
def test_one_wait_for_the_gpu_per_step():
    """No host sync in a step but the one that reads the sampled tokens: torch's sync debug mode flags every
    synchronising call; over a run of decode steps (greedy and seeded sampling) there is at most one per step."""
    import warnings

    llm = load_engine(GRAPHS).LLM("random:qwen3-0.6b", device="cuda", dtype="bfloat16", max_num_seqs=16)
    prompts, params = gpu_requests(n=8)
    params[2] = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, min_p=0.01, seed=5, max_tokens=30,
                               ignore_eos=True, logprobs=3)
    llm.generate(prompts, params)  # warm: the pinned memory and the kernels of these shapes exist
    steps, syncs = llm.timers.steps, llm.stats["syncs"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            llm.generate(prompts, params)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    steps = llm.timers.steps - steps
    flagged = [str(w.message) for w in caught if "called a synchronizing CUDA operation" in str(w.message)]
    assert llm.stats["syncs"] - syncs == steps  # every step sampled once, and waited once
    assert len(flagged) <= steps, f"{len(flagged)} syncs in {steps} steps: {flagged[:3]}"
    assert flagged, "the sync debug mode flagged nothing: the step's one wait (read_back) should show"
    print(f"{steps} steps, {len(flagged)} synchronising calls flagged")
