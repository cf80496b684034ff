"""Mutation checks: every lesson's tests fail when the lesson is broken (docs/reference/testing.md,
"Tests that can fail").

Not a pytest file (its name does not start with test_): a script that applies each mutation below, one at a
time, to a throwaway copy of the repository's tracked files at HEAD (`git archive`), never to the working tree,
and runs the mutation's pytest selection there twice: first unmutated (it must pass, or the mutation proves
nothing), then mutated (it must fail).

    .venv/bin/python tests/mutations.py                      # every mutation
    .venv/bin/python tests/mutations.py --list               # names and descriptions only
    .venv/bin/python tests/mutations.py --only step05-max-num-seqs --only step06-chunk-budget
    .venv/bin/python tests/mutations.py --all-failures       # no -x: list every test of the selection that fails
    .venv/bin/python tests/mutations.py --check              # only: does every old text occur once at HEAD?

Each selection is narrowed to the quickest tests of the table's row that catch the mutation (tiny-model and
kernel tests; the real-model lesson tests are left out), listed fastest first: pytest runs with -x, so the
first failure ends the mutated run. Each mutation is one exact text edit: `old` must occur exactly once in its file at HEAD, else the code moved and
the mutation must be updated (reported as "cannot apply"). The copy reads the models from the same cache folder
as this checkout (LLM_STEPS_CACHE, default <repo>/.cache): nothing is converted again.

Exit status 1 if any mutation was not caught, could not be applied, or its selection fails unmutated.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutation:
    name: str
    description: str  # the wording of docs/reference/testing.md's table
    file: str  # relative to the repository root
    old: str  # must occur exactly once in file
    new: str
    tests: tuple[str, ...]  # pytest arguments: node ids (fastest first), or a file and "-k", "expression"
    gpu: bool = False  # its tests are `gpu` tests: run only where CUDA is (elsewhere they would skip, and pass)


MUTATIONS_READ_BEFORE_LAUNCH_OLD = """        with self.timers.phase("schedule"):
            work = self.scheduler.schedule()  # counts step N's tokens as placeholders: one more token each
        step_n = self.in_flight
        try:
            self.in_flight = self._launch(work) if work else None
            outputs = self._read_step(step_n, partial) if step_n is not None else []
"""
MUTATIONS_READ_BEFORE_LAUNCH_NEW = """        step_n, self.in_flight = self.in_flight, None
        outputs = self._read_step(step_n, partial) if step_n is not None else []
        with self.timers.phase("schedule"):
            work = self.scheduler.schedule()
        try:
            self.in_flight = self._launch(work) if work else None
"""

MUTATIONS = [
    Mutation(
        "step05-max-num-seqs", "step05 ignores `max_num_seqs`",
        "steps/step05/scheduler.py",
        "while self.waiting and len(self.running) < self.max_num_seqs:",
        "while self.waiting:",
        ("tests/test_part2.py::test_random_arrivals_and_limits[step05]",)),
    Mutation(
        "step06-chunk-budget", "step06 ignores the chunk budget",
        "steps/step06/scheduler.py",
        "n = min(r.num_tokens - r.num_computed_tokens, budget)",
        "n = r.num_tokens - r.num_computed_tokens",
        ("tests/test_part2.py::test_chunked_prefill_any_budget[1-step06]",
         "tests/test_part2.py::test_chunked_prefill_any_budget[7-step06]")),
    Mutation(
        "step07-never-preempts", "step07 never preempts",
        "steps/step07/scheduler.py",
        "        while free < needed:\n",
        "        while False and free < needed:\n",
        ("tests/test_engine_api.py::test_preempted_status[step07]",
         "tests/test_part2.py::test_preemption_happens_and_changes_nothing[step07]")),
    Mutation(
        "step09-no-parent-check", "step09 drops the parent-block check",
        "steps/step09/block_manager.py",
        "if block.token_ids != block_tokens or block.parent != parent:",
        "if block.token_ids != block_tokens:",
        ("tests/test_part3.py::test_the_parent_block_tells_repeated_blocks_apart[step09]",)),
    Mutation(
        "step09-no-hits", "step09 skips every prefix hit",
        "steps/step09/block_manager.py",
        "            block_id = self.cached.get(h)\n",
        "            block_id = None\n",
        ("tests/test_part3.py::test_can_allocate_counts_hits_and_allocate_returns_them[step09]",
         "tests/test_part3.py::test_second_request_with_the_same_prefix_hits[step09]")),
    Mutation(
        "step09-can-allocate-ignores-hits", "step09's `can_allocate` ignores hits",
        "steps/step09/block_manager.py",
        "            needed -= sum(self.blocks[b].ref_count > 0",
        "            needed -= 0 * sum(self.blocks[b].ref_count > 0",
        ("tests/test_part3.py::test_can_allocate_counts_hits_and_allocate_returns_them[step09]",)),
    Mutation(
        "step08-failed-step-keeps-requests", "step08 does not release a failed step's requests",
        "steps/step08/engine.py",
        "            for r in scheduled:\n                self.abort_request(r.request_id)\n            raise\n",
        "            raise\n",
        ("tests/test_engine_api.py::test_a_failed_step_drops_its_requests[1-step08]",
         "tests/test_engine_api.py::test_a_failed_step_drops_its_requests[2-step08]",
         "tests/test_engine_api.py::test_a_failed_step_drops_its_requests[5-step08]")),
    Mutation(
        "step09-generate-drops-others", "step09's `generate()` drops another caller's finished request",
        "steps/step09/engine.py",
        "                        self.finished_outputs.append(out)\n",
        "                        pass\n",
        ("tests/test_engine_api.py::test_add_request_is_never_lost_to_generate[step09]",)),
    Mutation(
        "step14_1-slot-too-far", "step14_1's slot mapping writes one slot too far",
        "steps/step14_1/model.py",
        "return (blocks * block_size + positions % block_size).flatten()",
        "return (blocks * block_size + positions % block_size + 1).flatten()",
        ("tests/test_part5.py::test_vectorized_write_equals_the_loop[step14_1]",
         "tests/test_part5.py::test_outputs_equal_step13[step14_1-random:tiny-llama-16-7]")),
    Mutation(
        "step14_3-head-order", "step14_3 groups the query heads in the wrong order",
        "steps/step14_3/model.py",
        "q = q.view(T, kv_heads, group, head_dim).permute(1, 2, 0, 3)",
        "q = q.view(T, group, kv_heads, head_dim).permute(2, 1, 0, 3)",
        ("tests/test_part5.py::test_grouped_attention_equals_copies[4-2-step14_3]",)),
    Mutation(
        "step14_4-decode-mask", "step14_4 gives decode rows a mask",
        "steps/step14_4/model.py",
        "    if num_new == 1:\n        return None\n    keys = torch.arange(start + num_new, device=device)\n",
        "    keys = torch.arange(start + num_new, device=device)\n",
        ("tests/test_part5.py::test_mask_built_once_equals_the_per_row_mask[step14_4]",)),
    Mutation(
        "step14_5-rehash", "step14_5 rehashes a waiting prompt at every lookup",
        "steps/step14_5/block_manager.py",
        "        self.hash_new_blocks(request)\n        tokens, size, hits, parent = ",
        "        request.block_hashes.clear()\n        self.hash_new_blocks(request)\n        tokens, size, hits, parent = ",
        ("tests/test_part5.py::test_block_hashes_equal_step14_4s_and_are_computed_once[step14_5]",)),
    Mutation(
        "step14_6-evicts-first", "step14_6 evicts cached blocks before empty ones",
        "steps/step14_6/block_manager.py",
        "pool = self.empty or self.evictable",
        "pool = self.evictable or self.empty",
        ("tests/test_part5.py::test_lru_eviction_keeps_more_hits_than_step14_5[step14_6]",)),
    Mutation(
        "step14_7-forward-per-chunk", "step14_7 runs one forward per prefill chunk again (the counter)",
        "steps/step14_7/model_runner.py",
        "            self.stats[\"forwards\"] += 1\n",
        "            self.stats[\"forwards\"] += bool(decodes) + len(chunks)\n",
        ("tests/test_part5.py::test_one_forward_per_engine_step[step14_7-7]",
         "tests/test_part5.py::test_one_forward_per_engine_step[step14_7-512]")),
    Mutation(
        "step15-no-acc-rescale", "step15's kernel stops rescaling `acc` when the running maximum grows",
        "steps/step15/kernels/attention.py",
        "acc = tl.dot(p.to(v.dtype), v, acc * correction[:, None])",
        "acc = tl.dot(p.to(v.dtype), v, acc)",
        ("tests/test_part6.py::test_flash_attention_fp16",
         "tests/test_part6.py::test_flash_attention_equals_reference")),
    Mutation(
        "step15-no-diagonal-mask", "step15's kernel skips the causal mask on the diagonal tiles",
        "steps/step15/kernels/attention.py",
        "allowed = (keys_pos[None, :] <= query_pos[:, None]) & in_ctx[None, :]",
        "allowed = in_ctx[None, :]",
        ("tests/test_part6.py::test_flash_attention_fp16",
         "tests/test_part6.py::test_flash_attention_equals_reference")),
    Mutation(
        "step16-v2-no-rescale", "step16's v2 drops the rescale `exp2(m_old - m_new)`",
        "steps/step16/kernels/decode.py",
        "            alpha = tl.exp2(m - m_new)\n",
        "            alpha = tl.exp2(m_new - m_new)\n",
        ("tests/test_part6_decode.py::test_v2_any_block_size",
         "tests/test_part6_decode.py::test_v2_matches_reference",
         "tests/test_part6_decode.py::test_flash_decode_matches_reference_and_v2")),
    Mutation(
        "step17-merge-no-weights", "step17's merge drops the weights `exp2(m_p - M)`",
        "steps/step17/kernels/decode.py",
        "total = tl.sum(l * weight, axis=0)                       # L\n"
        "        out = tl.sum(acc * weight[:, None], axis=0)",
        "total = tl.sum(l, axis=0)                       # L\n"
        "        out = tl.sum(acc, axis=0)",
        ("tests/test_part6_decode.py::test_flash_decode_default_tile",
         "tests/test_part6_decode.py::test_flash_decode_matches_reference_and_v2")),
    Mutation(
        "step17-split-no-clamp", "step17's split kernel does not clamp its range to the context",
        "steps/step17/kernels/decode.py",
        "end_tile = tl.minimum(first_tile + tiles_per_split, num_tiles)",
        "end_tile = first_tile + tiles_per_split",
        ("tests/test_part6_decode.py::test_empty_splits_write_the_empty_state",
         "tests/test_part6_decode.py::test_flash_decode_matches_reference_and_v2")),
    Mutation(
        "step18-mixed-no-causal", "step18's mixed kernel lets every token of a chunk see the whole chunk",
        "steps/step18/kernels/attention.py",
        "query_pos = ctx - q_len + token  # each row's position in its sequence: causal within the chunk",
        "query_pos = ctx - 1 + token * 0  # each row's position in its sequence: causal within the chunk",
        ("tests/test_part6_mixed.py::test_mixed_kernel_equals_reference",)),
    Mutation(
        "step18-schedule-most-behind-first", "step18's scheduler serves the most behind first",
        "steps/step18/scheduler.py",
        "for r in sorted(self.running, key=behind):",
        "for r in sorted(self.running, key=lambda r: -behind(r)):",
        ("tests/test_part6_mixed.py::test_a_long_prompt_never_holds_back_a_decode",)),
    Mutation(
        "step18-rows-miss-new-blocks", "step18's block-table rows take a sequence's table once, never the blocks it appends",
        "steps/step18/model_runner.py",
        "            if new:\n                rows += [row] * len(new)",
        "            if new and start == 0:\n                rows += [row] * len(new)",
        ("tests/test_part6_block_tables.py::test_rows_take_only_the_new_blocks_and_are_reused[step18]",
         "tests/test_part6_block_tables.py::test_a_step_writes_only_the_new_blocks_and_the_tokens_are_unchanged"
         "[step18-torch]")),
    Mutation(
        "step18-rows-rewritten-whole", "step18 rewrites every scheduled sequence's whole block-table row every step",
        "steps/step18/model_runner.py",
        "            start = self.lengths[row]\n",
        "            start = 0\n",
        ("tests/test_part6_block_tables.py::test_a_step_writes_only_the_new_blocks_and_the_tokens_are_unchanged"
         "[step18-torch]",)),
    Mutation(
        "step19-norm-before-add", "step19's add + RMSNorm kernel normalises x without the residual",
        "steps/step19/kernels/fused.py",
        "s = (s.to(tl.float32) + r.to(tl.float32)).to(out_ptr.dtype.element_ty)  # the add, rounded as torch's",
        "s = (s.to(tl.float32) + 0 * r.to(tl.float32)).to(out_ptr.dtype.element_ty)  # the add, rounded as torch's",
        ("tests/test_part6_fused.py::test_add_rms_norm_equals_torch",)),
    Mutation(
        "step19-k-norm-with-q-weight", "step19's q/k norm + RoPE kernel normalises k's heads with q's weight",
        "steps/step19/kernels/fused.py",
        "is_q = heads < NUM_HEADS  # q's heads come first, then k's",
        "is_q = heads >= 0  # q's heads come first, then k's",
        ("tests/test_part6_fused.py::test_qk_norm_rope_equals_torch",)),
    Mutation(
        "step16-v1-empty-slots-score-0", "step16's v1 reads empty slots as score 0",
        "steps/step16/kernels/decode.py",
        "s = tl.load(scores_row + pos, mask=valid, other=float(\"-inf\"))",
        "s = tl.load(scores_row + pos, mask=valid, other=0.0)",
        ("tests/test_part6_decode.py::test_v1_matches_reference",)),
    # Not in the table (yet): the golden file, and a kernel of step17's own copy.
    Mutation(
        "step02-rope-k-only", "step02's attention rotates k but not q (the comparison with the golden file)",
        "steps/step02/model.py",
        "q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)",
        "q, k = q, apply_rope(k, cos, sin)",
        ("tests/test_equivalence.py::test_step_matches_golden[step02-random:tiny-llama]",)),
    Mutation(
        "step17-own-v2-no-rescale", "step17's own copy of v2 drops the rescale `exp2(m_old - m_new)`",
        "steps/step17/kernels/decode.py",
        "            alpha = tl.exp2(m - m_new)\n            p = tl.exp2(s - m_new[:, None])  # [BLOCK_G",
        "            alpha = tl.exp2(m_new - m_new)\n            p = tl.exp2(s - m_new[:, None])  # [BLOCK_G",
        ("tests/test_part6_decode.py::test_flash_decode_matches_reference_and_v2",)),
    Mutation(
        "step20-int8-keys-unscaled", "step20's mixed kernel reads int8 keys without multiplying by their scales",
        "steps/step20/kernels/attention.py",
        "            s = s * k_s[None, :]",
        "            s = s * 1.0",
        ("tests/test_part6_int8.py::test_mixed_kernel_int8_equals_dequantised_reference",)),
    Mutation(
        "step21-padding-writes-block-0", "step21's padding rows write their K/V to block 0, not the scratch block",
        "steps/step21/cuda_graphs.py",
        "        self.host_longs[2, num:size] = scratch_block * block_size\n",
        "        self.host_longs[2, num:size] = 0\n",
        ("tests/test_part7_graphs.py::test_padding_rows_write_only_the_scratch_block",)),
    Mutation(
        "step22-down-proj-not-reduced", "step22's row-parallel down_proj returns its rank's partial sum, not all-reduced",
        "steps/step22/model.py",
        "        return self.tp.all_reduce(down)  # row-parallel, like o_proj: one all-reduce",
        "        return down  # row-parallel, like o_proj: one all-reduce",
        ("tests/test_part7_tp.py::test_tp2_equals_tp1_with_preemption_and_prefix_caching[random:tiny-llama]",)),
    Mutation(
        "step22-worker-rows-miss-new-blocks", "step22's workers write a sequence's table into their rows once, never "
        "the blocks it appends",
        "steps/step22/parallel.py",
        "        changes.append((row, held, values[block_at:block_at + num_new]))",
        "        changes.append((row, held, values[block_at:block_at + num_new] if held == 0 else []))",
        ("tests/test_part7_tp.py::test_workers_keep_rank_0s_rows_and_the_broadcast_carries_only_new_blocks",)),
    Mutation(
        "step23-no-stop-holdback", "step23's partial outputs send all their text, a stop string's first half included",
        "steps/step23/sequence.py",
        "        hold = max(map(len, self.params.stop), default=1) - 1 if self.params.stop else 0",
        "        hold = 0",
        ("tests/test_part8_stream.py::test_a_stop_string_across_two_tokens_never_takes_back_text_already_streamed",)),
    Mutation(
        "step23-backlog-not-coalesced", "step23 hands a caller that fell behind every output that piled up",
        "steps/step23/async_llm.py",
        "                while not isinstance(item, BaseException) and not item.finished and not stream.queue.empty():",
        "                while False:",
        ("tests/test_part8_stream.py::test_a_caller_that_falls_behind_gets_the_newest_output",)),
    Mutation(
        "step23-failed-step-drops-all", "step23 drops every request of a step that failed, not only one that failed "
        "alone",
        "steps/step23/engine.py",
        "        if len(live) == 1:\n            self.scheduler.finish(live[0])\n            return\n",
        "        if live:\n            for seq in live:\n                self.scheduler.finish(seq)\n            return\n",
        ("tests/test_part8_isolation.py::test_a_request_that_fails_its_steps_fails_alone[step23-sync]",)),
    Mutation(
        "step18-mixed-launches-twice", "step18's mixed_attention launches its kernel twice (the same output)",
        "steps/step18/kernels/attention.py",
        "    _mixed_attention_kernel[(len(tile_seq), kv_heads)](",
        "    for _twice in range(2): _mixed_attention_kernel[(len(tile_seq), kv_heads)](",
        ("tests/test_part6_mixed.py::test_mixed_engine_equals_step17_with_one_launch_per_layer[random:tiny-llama-512]",)),
    Mutation(
        "step21-fill-copies-three-times", "step21's fill copies the context lengths and the block tables apart",
        "steps/step21/cuda_graphs.py",
        "        self.ints[:used].copy_(self.host_ints[:used], non_blocking=True)\n",
        "        self.ints[:self.max_seqs].copy_(self.host_ints[:self.max_seqs], non_blocking=True)\n"
        "        self.ints[self.max_seqs:used].copy_(self.host_ints[self.max_seqs:used], non_blocking=True)\n",
        ("tests/test_part7_graphs.py::test_fill_writes_the_rows_and_pads_to_the_scratch_block",)),
    Mutation(
        "step22-copy-mixed-no-causal", "step22's copy of the mixed kernel (otherwise step20's file) drops the causal mask "
        "within a row: the changed copy gets a run of its own",
        "steps/step22/kernels/attention.py",
        "query_pos = ctx - q_len + token  # each row's position in its sequence: causal within the chunk",
        "query_pos = ctx - 1 + token * 0  # each row's position in its sequence: causal within the chunk",
        ("tests/test_part6_mixed.py::test_mixed_kernel_equals_reference",)),
    Mutation(
        "step13-copy-top-k-off", "step13's copy of the sampler (otherwise step12's file) never cuts top-k: the changed "
        "copy gets a run of its own",
        "steps/step13/sampler.py",
        "    cut = k < vocab  # [..., 1]: the rows that ask for a cut\n",
        "    cut = k < 0  # [..., 1]: the rows that ask for a cut\n",
        ("tests/test_sampling.py::test_top_k_mask_is_exact",)),
    Mutation(
        "step24-gone-client-not-aborted", "step24's engine lets a request run on after its caller stopped reading",
        "steps/step24/async_llm.py",
        "            if not finished:  # the caller stopped early (break, cancel, an error): the request must not run on",
        "            if False:  # the caller stopped early (break, cancel, an error): the request must not run on",
        ("tests/test_part8_server.py::test_a_client_that_disconnects_mid_stream_frees_its_blocks",)),
    Mutation(
        "step25-read-before-launch", "step25 reads step N's tokens before it schedules and launches step N + 1",
        "steps/step25/engine.py",
        MUTATIONS_READ_BEFORE_LAUNCH_OLD, MUTATIONS_READ_BEFORE_LAUNCH_NEW,
        ("tests/test_part9_overlap.py::test_async_outputs_equal_step24_and_sync[random:tiny-llama]",)),
    Mutation(
        "step25-pending-not-filled", "step25 leaves a placeholder's input id (0) for the model instead of the "
        "device's token",
        "steps/step25/model_runner.py",
        "        if fill:\n            self.fill_placeholders(input_ids, fill)",
        "        if False:\n            self.fill_placeholders(input_ids, fill)",
        ("tests/test_part9_overlap.py::test_async_outputs_equal_step24_and_sync[random:tiny-llama]",)),
    Mutation(
        "step25-discarded-token-kept", "step25 records the token computed for a request after its end",
        "steps/step25/engine.py",
        "        live = [i for i, seq in enumerate(step.seqs) if seq.status is not SequenceStatus.FINISHED]",
        "        live = list(range(len(step.seqs)))",
        ("tests/test_part9_overlap.py::test_async_outputs_equal_step24_and_sync[random:tiny-llama]",)),
    Mutation(
        "step25-tp-tokens-not-shared", "step25's rank 0 keeps its sampled tokens from the tensor-parallel workers",
        "steps/step25/engine.py",
        "        self.runner.share_tokens = self.async_scheduling and self.workers is not None",
        "        self.runner.share_tokens = False",
        ("tests/test_part9_overlap.py::test_tensor_parallel_ranks_read_the_pending_tokens_from_rank_0",)),
    Mutation(
        "step26-outputs-cumulative", "step26's core sends each request's whole output every step, not the new tokens",
        "steps/step26/engine_core.py",
        "deltas.append(Delta(rid, sent, seq.output_ids[sent:known], logprobs, seq.cumulative_logprob))",
        "deltas.append(Delta(rid, 0, seq.output_ids[:known], logprobs, seq.cumulative_logprob))",
        ("tests/test_part9_core.py::test_outputs_cross_the_wire_as_deltas",)),
    Mutation(
        "step26-core-death-unseen", "step26's front end never notices that its core process is gone",
        "steps/step26/async_llm.py",
        "                    if not self.process.is_alive():\n",
        "                    if False:\n",
        ("tests/test_part9_core.py::test_sigkill_of_the_core_ends_open_streams",)),
    Mutation(
        "step26-deaf-core", "step26's core lives on when its input thread dies (it no longer hears the front end)",
        "steps/step26/engine_core.py",
        "    except BaseException as e:\n        core.inputs.put(_io_failure(\"input\", e))\n",
        "    except BaseException as e:\n        pass\n",
        ("tests/test_part9_faults.py", "-k", "io_thread_that_dies and input and step26")),
    Mutation(
        "step27-no-rollback", "step27 keeps the blocks of rejected drafts (no trim after a verify)",
        "steps/step27/scheduler.py",
        "            if seq.finish is None:\n                self.block_manager.trim(seq, seq.num_tokens)\n",
        "            if False:\n                self.block_manager.trim(seq, seq.num_tokens)\n",
        ("tests/test_part9_spec.py::test_kv_blocks_balance_after_every_step_of_rejections_preemption_and_abort",)),
    Mutation(
        "step27-accept-on-mismatch", "step27's verdict accepts every draft, whether or not it equals its place's token",
        "steps/step27/model_runner.py",
        "            while row < end and tokens[row] == ds[row - (end - len(ds))]:\n",
        "            while row < end:\n",
        ("tests/test_part9_spec.py::test_greedy_outputs_equal_step26_with_drafts_accepted",
         "tests/test_part9_spec.py::test_verify_keeps_the_target_distribution",
         "tests/test_part9_spec.py::test_sampled_outputs_follow_step26s_distribution")),
    Mutation(
        "step27-draw-salted", "step27's verdict draws with a key of its own, not the plain step's for that place (the "
        "tokens still follow p, but a seed's tokens depend on whether the request drafted)",
        "steps/step27/model_runner.py",
        "                seeds.append(seed)\n",
        "                seeds.append(seed ^ 0x5EC0)\n",
        ("tests/test_part9_spec.py::test_a_seeded_sampled_request_gets_step26s_tokens_alone_in_a_batch_and_under_"
         "budget_pressure",)),
    Mutation(
        "step28-gemv-no-norm", "step28's GEMV skips the division by the RMS of its folded norm (x times the norm "
        "weight only)",
        "steps/step28/kernels/gemv.py",
        "            rstd = (1.0 / tl.sqrt(sq / K + eps))[:, None]\n",
        "            rstd = (1.0 + sq * 0.0)[:, None]\n",
        ("tests/test_part10_fused.py::test_gemv_equals_its_reference[m1-n37-k576-norm-fp32]",)),
    Mutation(
        "step28-gemv-stale-prefetch", "step28's GEMV asks for the same weight tile again instead of the next one",
        "steps/step28/kernels/gemv.py",
        "            nks = ks + BLOCK_K\n",
        "            nks = ks\n",
        ("tests/test_part10_fused.py::test_gemv_equals_its_reference[m1-n37-k576-norm-fp32]",)),
    Mutation(
        "step28-merge-early", "step28's flash decoding merges in the next-to-last program to finish, not the last",
        "steps/step28/kernels/decode.py",
        "                if arrived == num_splits - 1:",
        "                if arrived == num_splits - 2:",
        ("tests/test_part10_fused.py::test_one_launch_flash_decoding_equals_split_then_merge[3-4-2-5]",)),
    Mutation(
        "step28-merge-no-reset", "step28's flash decoding leaves its arrival counters where they are after merging",
        "steps/step28/kernels/decode.py",
        "                    tl.atomic_xchg(counter, 0)\n",
        "                    counter = counter\n",
        ("tests/test_part10_fused.py::test_one_launch_flash_decoding_equals_split_then_merge[3-4-2-5]",)),
    Mutation(
        "step28-draw-no-rescale", "step28's draw adds the blocks' sums without moving them to the row's maximum",
        "steps/step28/kernels/sampling.py",
        "            sums = tl.where(here, sums * tl.exp(shifts / t_safe - top).to(tl.float64), 0.0)\n",
        "            sums = tl.where(here, sums, 0.0)\n",
        ("tests/test_part7_sampler.py::test_fused_draw_gives_the_torch_paths_tokens_and_logprobs[step28]",)),
    Mutation(
        "step28-gemv-no-residual", "step28's GEMV drops the residual add of its epilogue",
        "steps/step28/kernels/gemv.py",
        "            y = (y.to(tl.float32) + r.to(tl.float32)).to(dtype)\n",
        "            y = y\n",
        ("tests/test_part10_fused.py::test_gemv_equals_its_reference[m5-n33-k70-res-fp32]",)),
    Mutation(
        "step28-gemv-no-up", "step28's GEMV writes silu(gate) without the up product in its SiLU * up epilogue",
        "steps/step28/kernels/gemv.py",
        "            y = (act.to(tl.float32) * acc_up.to(dtype).to(tl.float32)).to(dtype)\n",
        "            y = act\n",
        ("tests/test_part10_fused.py::test_gemv_equals_its_reference[m8-n24-k64-norm-silu-fp32]",)),
    Mutation(
        "step28-kv-write-no-v", "step28's q/k norm + RoPE kernel stores K but not V",
        "steps/step28/kernels/fused.py",
        "            tl.store(vc_ptr + slot * stride_cs + kv * stride_ch + dims, v, mask=kv < KV_HEADS)\n",
        "            v = v\n",
        ("tests/test_part10_fused.py::test_qk_norm_rope_write_stores_what_write_kv_stores[9-3-64-False]",)),
    Mutation(
        "step28-o-proj-no-residual", "step28's o_proj and down_proj do not add the residual stream",
        "steps/step28/model.py",
        "            return self.ops.linear(a, weight, residual=x)\n",
        "            return self.ops.linear(a, weight)\n",
        ("tests/test_part10_fused.py::test_engine_equals_step27_bit_for_bit_on_the_torch_path[random:tiny-llama]",)),
    Mutation(
        "step29-gemv4-nibbles-swapped", "step29's 4-bit GEMV takes a byte's high nibble for the low one's input",
        "steps/step29/kernels/gemv4.py",
        "            q_low, q_high = _nibbles(byte, False, EXPONENT_TRICK), _nibbles(byte, True, EXPONENT_TRICK)\n",
        "            q_low, q_high = _nibbles(byte, True, EXPONENT_TRICK), _nibbles(byte, False, EXPONENT_TRICK)\n",
        ("tests/test_part10_int4.py::test_gemv4_equals_dequantise_then_matmul[1-48-64-False-False-False]",)),
    Mutation(
        "step29-gemv4-no-minimum", "step29's 4-bit GEMV drops the blocks' minimum (d * q only)",
        "steps/step29/kernels/gemv4.py",
        "                part = tl.sum(d32 * dot + mn32 * x_sum[None, :], axis=1)\n",
        "                part = tl.sum(d32 * dot, axis=1)\n",
        ("tests/test_part10_int4.py::test_gemv4_equals_dequantise_then_matmul[1-48-64-False-False-False]",)),
    Mutation(
        "step29-gemv4-minimum-as-scale", "step29's 4-bit GEMV takes the blocks' minimum for their scale",
        "steps/step29/kernels/gemv4.py",
        "            d32, mn32 = d.to(tl.float32), mn.to(tl.float32)\n",
        "            d32, mn32 = mn.to(tl.float32), mn.to(tl.float32)\n",
        ("tests/test_part10_int4.py::test_gemv4_equals_dequantise_then_matmul[1-48-64-False-False-False]",)),
    Mutation(
        "step29-q4-scale-and-min-swapped", "step29 reads a Q4_1 block's minimum as its scale and its scale as its minimum",
        "steps/step29/quant.py",
        "    scale = torch.from_numpy(blocks[..., 0:2].copy()",
        "    scale = torch.from_numpy(blocks[..., 2:4].copy()",
        ("tests/test_part10_int4.py::test_a_q4_1_file_reads_back_as_gguf_reads_it",)),
    Mutation(
        "step29-q-k-rows-not-restored", "step29 keeps llama.cpp's order of the q and k rows",
        "steps/step29/quant.py",
        "            if heads is not None:\n",
        "            if heads is not None and False:\n",
        ("tests/test_part10_int4.py::test_embedded_gguf_dequantises_to_the_float_checkpoint",)),
    Mutation(
        "step30-fp8-k-scale-not-applied", "step30's mixed attention kernel scores an fp8 cache without its k_scale",
        "steps/step30/kernels/attention.py",
        "        scale * LOG2E * (k_scale if fp8 else 1.0),\n",
        "        scale * LOG2E,\n",
        ("tests/test_part10_fp8.py::test_mixed_kernel_fp8_equals_dequantised_reference[16-4-4-64]",)),
    Mutation(
        "step30-fp8-v-scale-not-applied", "step30's flash decoding leaves an fp8 cache's v_scale off its output",
        "steps/step30/kernels/decode.py",
        "            acc = acc * out_scale\n",
        "            acc = acc\n",
        ("tests/test_part10_fp8.py::test_flash_decode_fp8_equals_dequantised_reference[16-4-4-64-1-False]",)),
    Mutation(
        "step30-fp8-no-conversion", "step30's flash decoding multiplies the fp8 rows without converting them",
        "steps/step30/kernels/decode.py",
        "            k, v = k.to(q.dtype), v.to(q.dtype)\n",
        "            k, v = k, v\n",
        ("tests/test_part10_fp8.py::test_flash_decode_fp8_equals_dequantised_reference[16-4-4-64-1-False]",)),
    Mutation(
        "step30-fp8-write-without-scale", "step30's fused write stores K in an fp8 cache without dividing by k_scale",
        "steps/step30/kernels/fused.py",
        "                out1 = _to_fp8_range(out1, k_scale)\n",
        "                out1 = _to_fp8_range(out1, 1.0)\n",
        ("tests/test_part10_fp8.py::test_the_fused_write_stores_what_the_torch_path_stores",)),
    Mutation(
        "step30-fp8-gemv-no-row-scale", "step30's GEMV leaves an fp8 weight's row scales off its outputs",
        "steps/step30/kernels/gemv.py",
        "            acc = acc * tl.load(scale_ptr + cols, mask=col_ok, other=0.0)[None, :]\n",
        "            acc = acc\n",
        ("tests/test_part10_fp8.py::test_fp8_gemv_equals_dequantise_then_matmul[1-48-64-False-False-False]",)),
    Mutation(
        "step31-moe-no-renormalisation", "step31's router leaves the top-k probabilities as they are (no "
        "renormalisation, though the model's config asks for it)",
        "steps/step31/model.py",
        "        weights = weights / weights.sum(dim=-1, keepdim=True)\n",
        "        weights = weights\n",
        ("tests/test_part10_moe.py::test_engine_equals_hf_qwen3_moe_batched_chunked_and_cached",)),
    Mutation(
        "step31-moe-first-expert-only", "step31's loop over the experts runs each token's first expert only",
        "steps/step31/model.py",
        "            rows, slot = torch.where(chosen == e)",
        "            rows, slot = torch.where(chosen[:, :1] == e)",
        ("tests/test_part10_moe.py::test_engine_equals_hf_qwen3_moe_batched_chunked_and_cached",)),
    Mutation(
        "step31-moe-down-no-router-weight", "step31's down kernel leaves the router weight off each pair's output",
        "steps/step31/kernels/moe.py",
        "        y = acc.to(a_ptr.dtype.element_ty).to(tl.float32) * weight[:, None]\n",
        "        y = acc.to(a_ptr.dtype.element_ty).to(tl.float32)\n",
        ("tests/test_part10_moe.py::test_fused_moe_equals_the_loop[5-2-None-random]",)),
    Mutation(
        "step31-moe-align-unpadded", "step31's align does not pad each expert's run to whole blocks",
        "steps/step31/kernels/moe.py",
        "    padded = (counts[:num_experts] + block_m - 1) // block_m * block_m\n",
        "    padded = counts[:num_experts]\n",
        ("tests/test_part10_moe.py::test_fused_moe_equals_the_loop[5-2-None-random]",)),
    Mutation(
        "step32-restore-wrong-slot", "step32's host tier restores a block from the slot after the right one",
        "steps/step32/offload.py",
        "                data[:, :, b].copy_(self.data[a], non_blocking=non_blocking)\n",
        "                data[:, :, b].copy_(self.data[(a + 1) % self.num_slots], non_blocking=non_blocking)\n",
        ("tests/test_part10_offload.py::test_evicted_blocks_come_back_from_host_memory",)),
    Mutation(
        "step32-copies-out-of-order", "step32's host tier runs the queued copy-backs before the copy-outs",
        "steps/step32/offload.py",
        "        queue, self.queue = self.queue, []\n",
        "        queue, self.queue = sorted(self.queue, key=lambda op: op[0] == \"out\"), []\n",
        ("tests/test_part10_offload.py::test_a_block_evicted_again_before_its_restore_ran",)),
    Mutation(
        "step32-sync-step-rings-for-tokens", "step32's synchronous steps tell the workers that rank 0's tokens follow",
        "steps/step32/model_runner.py",
        "        share_tokens = self.share_tokens and keep_on_device and bool(plan.sample_rows)\n",
        "        share_tokens = self.share_tokens and bool(plan.sample_rows)\n",
        ("tests/test_part9_overlap.py::test_tensor_parallel_steps_in_sync_after_a_failed_step_keep_the_ranks_in_step",)),
    Mutation(
        "step32-workers-skip-host-copies", "step32's tensor-parallel workers never run the host tier's copies",
        "steps/step32/worker.py",
        "    copies = [(COPY_KINDS[k], a, b) for k, a, b in zip(*[iter(values[block_at + 1:])] * 3)]\n",
        "    copies = []\n",
        ("tests/test_part10_offload.py::test_two_ranks_with_the_tier_equal_one_and_every_rank_copies_its_share",)),
    Mutation(
        "step33-scale-of-the-latent-row", "step33's softmax scale is 1 / sqrt(kv_lora_rank + rope), the cache row's "
        "width, not 1 / sqrt(nope + rope), a query head's",
        "steps/step33/model.py",
        "                attention_scale=(nope + rope) ** -0.5, scoring_func=scoring,",
        "                attention_scale=(kv_lora + rope) ** -0.5, scoring_func=scoring,",
        ("tests/test_part10_mla.py::test_engine_equals_hf_deepseek_batched_chunked_cached_and_preempted",)),
    Mutation(
        "step33-bias-in-the-weights", "step33's router weighs the chosen experts with the bias-corrected scores "
        "(the bias is for the choice only)",
        "steps/step33/model.py",
        "    weights = scores.gather(1, experts)\n",
        "    weights = choice.gather(1, experts)\n",
        ("tests/test_part10_mla.py::test_engine_equals_hf_deepseek_batched_chunked_cached_and_preempted",)),
    Mutation(
        "step33-rope-not-interleaved", "step33 turns the roped dims as halves where DeepSeek turns adjacent pairs",
        "steps/step33/model.py",
        "        turn = apply_rope_pairs if c.rope_interleave else apply_rope\n",
        "        turn = apply_rope\n",
        ("tests/test_part10_mla.py::test_engine_equals_hf_deepseek_batched_chunked_cached_and_preempted",)),
    Mutation(
        "step33-shared-expert-dropped", "step33's sparse layers leave out the shared experts' MLP",
        "steps/step33/model.py",
        "            out = out + self.ops.linear(shared,",
        "            out = out + 0 * self.ops.linear(shared,",
        ("tests/test_part10_mla.py::test_engine_equals_hf_deepseek_batched_chunked_cached_and_preempted",)),
    Mutation(
        "step33-chunks-keys-without-rope", "step33's prefill chunks on the triton backend decompress keys without "
        "their roped dims",
        "steps/step33/attention.py",
        "        keys, values = pad(keys).view(-1, block, heads, width), pad(values).view(-1, block, heads, width)\n",
        "        keys = torch.cat([keys[..., :m.nope], 0 * keys[..., m.nope:]], dim=-1)\n"
        "        keys, values = pad(keys).view(-1, block, heads, width), pad(values).view(-1, block, heads, width)\n",
        ("tests/test_part10_mla.py::test_the_triton_backend_follows_the_torch_path",)),
    Mutation(
        "step33-absorbed-without-w-uv", "step33's absorbed path skips W_UV: the latents' mix taken as the values",
        "steps/step33/attention.py",
        "    out = torch.einsum(\"hts,sc->thc\", probs, latents)  # [T, heads, kv_lora_rank]\n"
        "    return torch.einsum(\"thc,hvc->thv\", out, m.w_uv).flatten(1)\n",
        "    out = torch.einsum(\"hts,sc->thc\", probs, latents)  # [T, heads, kv_lora_rank]\n"
        "    return out[..., :m.w_uv.shape[1]].flatten(1)\n",
        ("tests/test_part10_mla.py::test_the_absorbed_path_equals_the_decompressed_one", "tests/test_part10_mla.py::test_engine_equals_hf_deepseek_batched_chunked_cached_and_preempted")),
    Mutation(
        "step34-stream-not-sent", "step34's later stages drop the residual stream the stage before sent: each starts "
        "from zeros",
        "steps/step34/model.py",
        "        x = self.embed(input_ids) if hidden is None else hidden  # [N, hidden]: the residual stream\n",
        "        x = self.embed(input_ids) if hidden is None else torch.zeros_like(hidden)\n",
        ("tests/test_part11_pp.py::test_pp_equals_one_stage_batched_chunked_preempted_and_cached",)),
    Mutation(
        "step34-wrong-stages-layers", "step34's every stage builds the first layers (as many as its own), not its own",
        "steps/step34/model.py",
        "            full = replace(full, layer_range=(pipe.layers.start, pipe.layers.stop))\n",
        "            full = replace(full, layer_range=(0, len(pipe.layers)))\n",
        ("tests/test_part11_pp.py::test_pp_equals_one_stage_batched_chunked_preempted_and_cached",
         "tests/test_part11_pp.py::test_each_rank_holds_its_layers_kv_and_sends_a_hidden_state_per_token")),
    Mutation(
        "step34-request-in-two-batches", "step34's scheduler puts a request in flight into the next batch too",
        "steps/step34/scheduler.py",
        "            if r.request_id in self.in_flight:  # in a batch the pipeline still runs: one batch at a time\n"
        "                continue\n",
        "",
        ("tests/test_part11_pp.py::test_batches_overlap_up_to_pp_and_no_request_is_in_two",)),
    Mutation(
        "step35-blocks-in-the-wrong-order", "step35's producer sends a request's blocks last first",
        "steps/step35/kv_connector.py",
        "            index = torch.tensor(lease.blocks[first:first + count])\n",
        "            index = torch.tensor(lease.blocks[first:first + count][::-1])\n",
        ("tests/test_part11_pd.py::test_the_consumer_decodes_from_the_producers_blocks_as_one_engine",)),
    Mutation(
        "step35-last-partial-block-dropped", "step35's consumer pulls the prompt's whole blocks only, not its last "
        "partial one",
        "steps/step35/core.py",
        "        first, last = seq.num_computed_tokens // size, -(-prompt_len // size)\n",
        "        first, last = seq.num_computed_tokens // size, prompt_len // size\n",
        ("tests/test_part11_pd.py::test_the_consumer_decodes_from_the_producers_blocks_as_one_engine",)),
    Mutation(
        "step35-lease-never-freed", "step35's producer never frees a lent request's blocks (no ack, no expiry)",
        "steps/step35/kv_connector.py",
        "        for lease in freed:\n            release(lease.seq)\n",
        "        for lease in freed:\n            self.leases[lease.seq.request_id] = lease\n",
        ("tests/test_part11_pd.py::test_a_lease_that_is_never_acknowledged_expires_and_frees_the_blocks",
         "tests/test_part11_pd.py::test_the_consumer_decodes_from_the_producers_blocks_as_one_engine")),
    # GPU: the CUDA-graph path fills placeholders' ids in the graphs' static inputs, a second site the CPU never runs
    Mutation(
        "step25-graph-pending-not-filled", "step25's CUDA graphs replay with a placeholder's input id (0) instead "
        "of the device's token",
        "steps/step25/model_runner.py",
        "                if placeholders:  # row i of the static inputs is sequence i\n"
        "                    self.fill_placeholders(",
        "                if False:  # row i of the static inputs is sequence i\n"
        "                    self.fill_placeholders(",
        ("tests/test_part9_overlap.py::test_gpu_async_equals_step24_exactly_while_the_batches_match",), gpu=True),
    Mutation(
        "step25-read-before-launch-gpu", "step25 reads step N's tokens before it launches step N + 1 (the GPU's "
        "ordering test)",
        "steps/step25/engine.py",
        MUTATIONS_READ_BEFORE_LAUNCH_OLD, MUTATIONS_READ_BEFORE_LAUNCH_NEW,
        ("tests/test_part9_overlap.py::test_gpu_step_n_plus_1_is_launched_before_step_n_ends",), gpu=True),
]


def model_cache() -> Path:
    """The cache folder shared/models.py uses in this checkout: the copy must read the same one."""
    return Path(os.environ.get("LLM_STEPS_CACHE", REPO / ".cache")).resolve()


def make_copy(rev: str) -> Path:
    """The tracked files at `rev`, in a fresh temporary folder (never the working tree). rev "files": a copy of the
    files as they are (for a machine that has the files but not the repository, like the GPU machine)."""
    tmp = Path(tempfile.mkdtemp(prefix="mutations-"))
    if rev == "files":
        shutil.copytree(REPO, tmp, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns(".git", ".cache", ".venv", "__pycache__", ".scratch"))
        return tmp
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tmp)], input=archive, check=True)
    return tmp


def run_pytest(copy: Path, tests: tuple[str, ...], stop_first: bool, timeout: int) -> tuple[int, list[str], str]:
    """-> (pytest's exit status, the failing/erroring test ids, the output's tail)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_XDIST_WORKER"}
    env.update(LLM_STEPS_CACHE=str(model_cache()), PYTHONDONTWRITEBYTECODE="1")
    cmd = [sys.executable, "-m", "pytest", *(["-x"] if stop_first else []), "-q", "-p", "no:cacheprovider",
           "-p", "no:randomly", "-rfE", "--no-header", *tests]
    try:
        proc = subprocess.run(cmd, cwd=copy, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        return -1, [], out[-3000:] + f"\n[timed out after {timeout} s]"
    out = proc.stdout + proc.stderr
    failed = [m.group(2) for m in re.finditer(r"^(FAILED|ERROR) (\S+)", out, re.M)]
    return proc.returncode, list(dict.fromkeys(failed)), out[-3000:]


def short(test_id: str) -> str:
    return test_id.split("::", 1)[-1]


def check(m: Mutation, copy: Path, stop_first: bool, timeout: int, verbose: bool) -> tuple[bool, str]:
    """Apply one mutation in `copy`, run its selection before and after. -> (ok, one report line)."""
    path = copy / m.file
    start = time.perf_counter()
    if not path.exists():
        return False, f"{m.name:34} CANNOT APPLY: {m.file} does not exist"
    original = path.read_text()
    count = original.count(m.old)
    if count != 1:
        return False, (f"{m.name:34} CANNOT APPLY: the old text occurs {count} times in {m.file} "
                       f"(the code moved: update the mutation)")
    rc, failed, tail = run_pytest(copy, m.tests, stop_first, timeout)
    clean = rc == 0
    if verbose or not clean:
        print(f"--- {m.name}, unmutated: exit {rc}\n{tail}", flush=True)
    if not clean:
        why = "no test collected (ids changed?)" if rc in (4, 5) else f"exit {rc}, failing: {[short(t) for t in failed]}"
        return False, f"{m.name:34} passed-unmutated NO ({why})  {time.perf_counter() - start:.0f}s"
    try:
        path.write_text(original.replace(m.old, m.new))
        rc, failed, tail = run_pytest(copy, m.tests, stop_first, timeout)
    finally:
        path.write_text(original)
    if verbose or rc != 1:
        print(f"--- {m.name}, mutated: exit {rc}\n{tail}", flush=True)
    caught = rc == 1 and bool(failed)
    seconds = time.perf_counter() - start
    verdict = f"caught: {len(failed)} failed: {', '.join(short(t) for t in failed)}" if caught else \
        f"NOT CAUGHT (exit {rc}{', errors: ' + ', '.join(short(t) for t in failed) if failed else ''})"
    return caught, f"{m.name:34} passed-unmutated yes  failed-when-mutated {'yes' if caught else 'NO'}  " \
                   f"{seconds:4.0f}s  {verdict}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", action="append", default=[], metavar="NAME", help="run only these (repeatable)")
    parser.add_argument("--list", action="store_true", help="print the mutations and exit")
    parser.add_argument("--rev", default="HEAD", help="the commit whose tracked files are copied (default HEAD); "
                        "'files': the files as they are, no git needed")
    parser.add_argument("--all-failures", action="store_true",
                        help="run pytest without -x: every failing test of the selection is listed (slower)")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per pytest run")
    parser.add_argument("--check", action="store_true",
                        help="only check that every old text occurs exactly once at --rev (runs no test)")
    parser.add_argument("-v", "--verbose", action="store_true", help="print pytest's output tail of every run")
    args = parser.parse_args(argv)

    names = [m.name for m in MUTATIONS]
    assert len(set(names)) == len(names), "two mutations share a name"
    unknown = [n for n in args.only if n not in names]
    if unknown:
        parser.error(f"unknown mutation(s) {unknown}; known: {', '.join(names)}")
    chosen = [m for m in MUTATIONS if not args.only or m.name in args.only]
    if args.list:
        for m in chosen:
            print(f"{m.name:34} {m.description}\n{'':34} {m.file}; expected to fail: "
                  f"{' '.join(short(t) for t in m.tests)}")
        return 0

    if args.check:
        bad = 0
        for m in chosen:
            shown = subprocess.run(["git", "-C", str(REPO), "show", f"{args.rev}:{m.file}"], capture_output=True, text=True)
            count = shown.stdout.count(m.old) if shown.returncode == 0 else 0
            bad += count != 1
            print(f"{m.name:34} {'applies' if count == 1 else f'CANNOT APPLY: old text found {count} times in {m.file}'}")
        return 1 if bad else 0

    import torch  # only to ask whether the `gpu` mutations can run here
    if not torch.cuda.is_available():
        gpu_only = [m for m in chosen if m.gpu]
        for m in gpu_only:
            print(f"{m.name:34} not run: its tests need CUDA (run it on a GPU machine)", flush=True)
        chosen = [m for m in chosen if not m.gpu]
        if args.only and gpu_only:
            return 1  # asked for by name, and not run
    cache = model_cache()
    if not cache.is_dir():
        print(f"warning: the model cache {cache} does not exist: models will be converted into it", flush=True)
    commit = "the files as they are" if args.rev == "files" else subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short", args.rev], check=True, capture_output=True, text=True).stdout.strip()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # killed: still remove the copy (finally below)
    copy = make_copy(args.rev)
    print(f"{len(chosen)} mutation(s) of {args.rev} ({commit}), copied to {copy}; models from {cache}", flush=True)
    results = []
    try:
        for m in chosen:
            ok, line = check(m, copy, not args.all_failures, args.timeout, args.verbose)
            results.append(ok)
            print(line, flush=True)
    finally:
        shutil.rmtree(copy, ignore_errors=True)
    bad = results.count(False)
    print(f"{len(results) - bad} of {len(results)} mutations caught" + (f"; {bad} NOT OK" if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
