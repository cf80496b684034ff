"""The step34 chapter's pipeline bubbles, measured on this machine's CPU: the same requests through two stages with
one batch in flight (async_scheduling=False) and with two (async_scheduling=True), each stage's forwards recorded
(start, end) by its own process (parallel.py's Pipeline.timeline, time.perf_counter: one clock for the processes of a
machine). A stage's idle share is the part of the run's window (the first stage's first start to the last stage's
last end) in which it computed nothing (parallel.py's idle_shares). Greedy, EOS ignored; the tokens of the two runs
are checked equal.

    python docs/data/pp_bubbles.py > docs/data/raw/cpu_pp_bubbles.txt
"""
import os
import sys
import time
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

MODEL, REQUESTS, TOKENS, PER_BATCH = "random:smollm2-135m", 8, 16, 4


def run(async_scheduling: bool) -> dict:
    from shared import SamplingParams
    from steps.step34.engine import LLM
    from steps.step34.parallel import idle_shares

    llm = LLM(MODEL, device="cpu", dtype="float32", max_kv_tokens=8192, pipeline_parallel_size=2,
              max_num_seqs=PER_BATCH, async_scheduling=async_scheduling)
    prompts = [f"Question {i}: what is {i} + {i}?" for i in range(REQUESTS)]
    sp = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=2))  # warm-up
    core = llm.core
    core.pipe.timeline.clear()
    core.launches.clear()
    skip = len(core.workers.stages()[0]["timeline"])
    start = time.perf_counter()
    outs = llm.generate(prompts, sp)
    wall = time.perf_counter() - start
    report, = core.workers.stages()
    shares = idle_shares([list(core.pipe.timeline), report["timeline"][skip:]])
    batches = sum(kind == "launch" for kind, _, _ in core.launches)
    llm.shutdown()
    return {"tokens": [o.outputs[0].token_ids for o in outs], "wall": wall, "shares": shares, "batches": batches,
            "depth": core.depth, "tokens_per_s": REQUESTS * TOKENS / wall}


def main() -> None:
    runs = {False: run(False), True: run(True)}
    print(f"{MODEL} over 2 stages (15 + 15 layers) on this machine's CPU ({os.cpu_count()} cores), {REQUESTS} requests "
          f"x {TOKENS} greedy tokens, up to {PER_BATCH} requests a batch:")
    print("batches in flight  batches  stage 0 idle  stage 1 idle  tokens/s")
    print("-----------------  -------  ------------  ------------  --------")
    for r in runs.values():
        print(f"{r['depth']:>17}  {r['batches']:>7}  {r['shares'][0]:>12.0%}  {r['shares'][1]:>12.0%}  "
              f"{r['tokens_per_s']:>8.1f}")
    same = runs[False]["tokens"] == runs[True]["tokens"]
    print("The two runs' tokens are " + ("equal." if same else "NOT equal."))


if __name__ == "__main__":
    main()
