"""step18 on: persistent block-table rows (model_runner.py's BlockTables). Every running sequence keeps one row of a
host tensor from step to step; a step writes into it only the blocks the sequence got since its last step, and the
kernels' block tables and the slot mapping are read from the rows, never rebuilt from the sequences' lists.

- The rows, unit by unit: a first schedule writes the whole table, a step without a new block writes nothing, one
  new block is one entry; a released row is taken by the next sequence; gather() and slots() give what the lists
  give (model.py's slot_mapping is the oracle); too wide a table, too many sequences and a table that shrank (its
  release was not told to the rows) are errors.
- The engine, counted every step: the entries written are exactly the blocks the scheduled sequences' tables grew
  by since their last step (a decode that crosses no block boundary writes 0, one that crosses writes 1), while the
  rows hold every running sequence's table; in a small pool requests are preempted and rows are reused, no row is
  left held at the end, and the tokens are step17's (which rebuilt the tables every step), token for token.
"""
import functools
import random

import pytest
import torch

from helpers import STEP_LOGPROB_ATOL_FP32, RowWrites, compare_completions, load_engine, step_module
from registry import has, having, introducing, last_before
from shared import SamplingParams

ROWS = introducing("block_table_rows")
BEFORE = last_before("block_table_rows")
CPU = torch.device("cpu")


def block_tables(step, max_rows=4, max_blocks=6):
    return step_module(step, "model_runner").BlockTables(max_rows, max_blocks, CPU)


class FakeSeq:
    """What the rows read of a sequence: its request id and its block table."""

    def __init__(self, request_id, block_table):
        self.request_id, self.block_table = request_id, list(block_table)


def step_rows(step, tables, seqs):
    """One step's block-table update, as the runner does it -> (its rows, the entries written into the rows tensor,
    counted as the operators run: RowWrites)."""
    with RowWrites(tables) as writes:
        rows = tables.write(changes(step, tables, seqs))
    return rows, writes.entries


def changes(step, tables, seqs):
    """BlockTables.changes for a step of these sequences: from the plan's request ids and tables where the runner
    reads a plan (scheduler_output), from the scheduled [(sequence, n)] before."""
    if has(step, "scheduler_output"):
        return tables.changes([seq.request_id for seq in seqs], [seq.block_table for seq in seqs])
    return tables.changes([(seq, 1) for seq in seqs])


def release(step, tables, seq):
    """The block manager's on_release: by request id where the runner reads a plan, the request itself before."""
    tables.release(seq.request_id if has(step, "scheduler_output") else seq)


@pytest.mark.parametrize("step", having("block_table_rows"))
def test_rows_take_only_the_new_blocks_and_are_reused(step):
    tables = block_tables(step)
    a, b = FakeSeq("a", [7, 2, 9]), FakeSeq("b", [4])
    rows, written = step_rows(step, tables, [a, b])
    assert rows == [0, 1] and written == 4  # the first time: whole tables
    assert tables.held() == {0: [7, 2, 9], 1: [4]}
    assert step_rows(step, tables, [b, a]) == ([1, 0], 0)  # nothing new: nothing written, the rows in the work's order
    a.block_table.append(5)
    assert step_rows(step, tables, [a, b]) == ([0, 1], 1)  # one new block: one entry
    assert tables.held() == {0: [7, 2, 9, 5], 1: [4]}
    release(step, tables, a)  # its blocks went back to the pool
    release(step, tables, FakeSeq("never-scheduled", []))  # a waiting request that had no row: nothing to give back
    c = FakeSeq("c", [3])
    rows, written = step_rows(step, tables, [b, c])
    assert rows == [1, 0] and written == 1  # c takes a's row, from its first entry
    assert tables.held() == {0: [3], 1: [4]}  # a's old entries past c's one block are stale, and not c's table
    assert tables.rows[0, :4].tolist()[1:] == [2, 9, 5]  # (still there: never read, never cleared)
    assert tables.gather([1, 0]).tolist() == [[4], [3]]  # cut to the widest row of the step
    b.block_table += [8, 6]
    assert step_rows(step, tables, [b, c]) == ([1, 0], 2)
    gathered = tables.gather([0, 1]).tolist()
    assert gathered[1] == [4, 8, 6] and gathered[0][0] == 3 and len(gathered[0]) == 3  # past c's one: stale
    with pytest.raises(ValueError, match="wider than the rows' 6"):
        step_rows(step, tables, [FakeSeq("wide", range(7))])


@pytest.mark.parametrize("step", having("block_table_rows"))
def test_gather_and_slots_equal_what_the_lists_give(step):
    """The slots read from the rows are model.slot_mapping's, computed from the lists; the gathered tables hold each
    sequence's list up to its length, whichever rows the sequences hold."""
    rng = random.Random(18)
    tables = block_tables(step, max_rows=6, max_blocks=10)
    seqs = [FakeSeq(str(i), rng.sample(range(50), rng.randrange(1, 10))) for i in range(6)]
    step_rows(step, tables, seqs[:3])
    release(step, tables, seqs[1])
    order = [seqs[4], seqs[0], seqs[5], seqs[2], seqs[3]]  # rows 1, 0, 3, 2, 4: not in the work's order
    rows, _ = step_rows(step, tables, order)
    block_size = 4
    starts = [rng.randrange(0, len(s.block_table) * block_size) for s in order]
    lens = [rng.randrange(1, len(s.block_table) * block_size - p + 1) for s, p in zip(order, starts)]
    positions = torch.tensor([p for start, n in zip(starts, lens) for p in range(start, start + n)])
    expected = step_module(step, "model").slot_mapping(starts, lens, [s.block_table for s in order], block_size)
    got = tables.slots(rows, positions, lens, block_size)
    assert got.dtype == torch.int64 and got.tolist() == expected.tolist()
    gathered = tables.gather(rows)
    assert gathered.dtype == torch.int32 and gathered.shape == (5, max(len(s.block_table) for s in order))
    for row, seq in zip(gathered.tolist(), order):
        assert row[:len(seq.block_table)] == seq.block_table


@pytest.mark.parametrize("step", having("block_table_rows"))
def test_more_sequences_than_rows_and_a_release_not_told_are_errors(step):
    tables = block_tables(step, max_rows=2)
    a = FakeSeq("a", [1, 4])
    step_rows(step, tables, [a, FakeSeq("b", [2])])
    with pytest.raises(RuntimeError, match="no free block-table row: all 2 are held"):
        step_rows(step, tables, [FakeSeq("c", [3])])
    a.block_table = [5]  # given back and begun again (a preemption) without the rows being told
    with pytest.raises(RuntimeError, match="request a: a block table of 1 blocks in a row holding 2"):
        step_rows(step, tables, [a])


# ---- the engine -------------------------------------------------------------------------------------------
def requests(seed=18, n=7):
    """Prompts of 3..45 tokens and 5..29 new tokens, one seeded sample among the greedy ones: with blocks of 4 the
    decodes cross block boundaries every fourth token, and the requests finish one by one."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(1, 1000) for _ in range(length)] for length in (3, 17, 45, 9, 28, 5, 33)[:n]]
    params = [SamplingParams(temperature=0, max_tokens=5 + 4 * i, ignore_eos=True, logprobs=1) for i in range(n)]
    params[3] = SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=14, ignore_eos=True, logprobs=1)
    return prompts, params


def run_counted(llm, prompts, params):
    """drive() the requests, checking the rows after every step. -> (the outputs by request, what was counted)."""
    tables, scheduler = llm.runner.block_tables, llm.scheduler
    block_size = llm.block_manager.block_size
    schedule, scheduled = scheduler.schedule, []

    def recorded():
        work = schedule()
        # as scheduled: a request that finishes in the step has given its table back by the end of it
        scheduled.append([(seq, n, seq.num_computed_tokens, len(seq.block_table)) for seq, n in work])
        return work

    scheduler.schedule = recorded
    step = llm.step

    def counted_step(*args, **kwargs):  # the entries written into the rows tensor during the step (RowWrites)
        with RowWrites(tables) as writes:
            outs = step(*args, **kwargs)
        state["written"] = writes.entries
        return outs

    llm.step = counted_step
    counted = {"decode_steps_writing_0": 0, "decode_steps_writing": 0, "entries": 0, "preempted_rows_freed": 0}
    owners: dict[int, set] = {}  # row -> every request that held it
    last_len: dict[str, int] = {}  # request -> its table's length after the last step that scheduled it
    state = {}

    def before_step():
        state.update(preemptions=scheduler.num_preemptions)

    def after_step(steps):
        nonlocal last_len
        work, written, preemptions = scheduled[-1], state["written"], state["preemptions"]
        # what the tables grew by since each sequence's last step: the whole table for one without a row
        grown = sum(length - last_len.get(seq.request_id, 0) for seq, _, _, length in work)
        assert written == grown, f"step {steps}: {written} entries written, the tables grew by {grown}"
        counted["entries"] += written
        if all(n == 1 and seq.request_id in last_len for seq, n, _, _ in work):  # decodes only, each with a row
            crossing = sum(start % block_size == 0 for _, _, start, _ in work)  # its newest token opens a block
            assert written == crossing, f"step {steps}: {written} entries for {crossing} decodes crossing a block"
            counted["decode_steps_writing_0" if written == 0 else "decode_steps_writing"] += 1
        # the rows hold every running sequence's table, and nobody else's
        held = tables.held()
        assert {tables.row_of[seq.request_id]: seq.block_table for seq in scheduler.running
                if seq.request_id in tables.row_of} == held
        for request_id, row in tables.row_of.items():
            owners.setdefault(row, set()).add(request_id)
        if scheduler.num_preemptions > preemptions:  # a preempted request that held a row has given it back
            preempted = [seq for seq in scheduler.waiting if seq.request_id in last_len]
            assert all(seq.request_id not in tables.row_of for seq in preempted)
            counted["preempted_rows_freed"] += len(preempted)
        running = {seq.request_id for seq in scheduler.running}  # finished and preempted requests start again
        last_len = {r: n for r, n in last_len.items() if r in running}
        last_len.update((seq.request_id, length) for seq, _, _, length in work if seq.request_id in running)

    outs = drive(llm, prompts, params, before_step, after_step)
    assert tables.row_of == {} and not any(tables.lengths), "a row is still held after every request finished"
    assert sorted(tables.free_rows) == list(range(tables.max_rows))
    counted["reused_rows"] = sum(len(ids) > 1 for ids in owners.values())
    counted["preemptions"] = scheduler.num_preemptions
    return outs, counted


def drive(llm, prompts, params, before_step=lambda: None, after_step=lambda steps: None):
    """All requests but the last two at once, those two joining at the third step; the engine stepped by hand.
    -> the outputs, by request."""
    for p, sp in zip(prompts[:-2], params[:-2]):
        llm.add_request(p, sp)
    outs, steps = [], 0
    while llm.has_unfinished_requests():
        before_step()
        outs += llm.step()
        steps += 1
        after_step(steps)
        if steps == 3:
            for p, sp in zip(prompts[-2:], params[-2:]):
                llm.add_request(p, sp)
    return sorted(outs, key=lambda o: int(o.request_id))


def engine_cases():
    """The lesson step on the kernels' path (Triton's interpreter: the gathered block tables are what they read) and
    the torch path (the slot mapping from the rows); every later copy on the torch path."""
    cases = []
    for step in having("block_table_rows"):
        for backend in (["triton", "torch"] if step == introducing("block_table_rows") else ["torch"]):
            cases.append(pytest.param(step, backend, id=f"{step}-{backend}"))
    return cases


@functools.lru_cache(maxsize=None)
def before_outputs(backend):
    """step17's outputs on requests() under the options of the test below, computed once per test process: every
    step is compared with the same run, and the tests only read it."""
    options = dict(device="cpu", max_num_seqs=4, max_num_batched_tokens=32, block_size=4, max_kv_tokens=96,
                   attention_backend=backend)
    return drive(load_engine(BEFORE).LLM("random:tiny-qwen3", **options), *requests())


@pytest.mark.parametrize("step,backend", engine_cases())
def test_a_step_writes_only_the_new_blocks_and_the_tokens_are_unchanged(step, backend):
    """A pool of 96 tokens in blocks of 4 for seven requests of up to 74 tokens, at most 4 at once: preemption, rows
    reused as requests finish and join. Counted every step (run_counted); the outputs equal step17's, whose runner
    rebuilt every block table from the lists every step."""
    if backend == "triton":
        pytest.importorskip("triton")
    prompts, params = requests()
    options = dict(device="cpu", max_num_seqs=4, max_num_batched_tokens=32, block_size=4, max_kv_tokens=96,
                   attention_backend=backend)
    expected = before_outputs(backend)
    llm = load_engine(step).LLM("random:tiny-qwen3", **options)
    got, counted = run_counted(llm, prompts, params)
    assert len(got) == len(prompts)
    for a, b in zip(got, expected):
        compare_completions(a.outputs[0], b.outputs[0], STEP_LOGPROB_ATOL_FP32, label=f"request {a.request_id}")
    print(step, backend, counted)
    assert counted["preemptions"] > 0 and counted["preempted_rows_freed"] > 0, counted
    assert counted["reused_rows"] > 0, counted  # a finished or preempted request's row served another
    assert counted["decode_steps_writing_0"] > 0 and counted["decode_steps_writing"] > 0, counted
    if has(step, "cuda_graphs"):
        assert llm.runner.graphs is None  # the CPU runs eagerly: the graphs' fill is tested in test_part7_graphs
