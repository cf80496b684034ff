"""The step35 chapter's mixed workload, at the CPU's scale: decoding streams, and long prompts arriving among them.
Each engine is serve.py in a process of its own on 127.0.0.1. Colocated: one engine runs everything (its torch
threads: every core). Apart: a kv_producer and a kv_consumer (one core each) behind router.py. The clients: STREAMS
streamed completions of DECODE_TOKENS tokens each (short prompts), and once they all decode, LONG prompts of
LONG_TOKENS tokens (8 new tokens each), one every GAP_S seconds. The time between tokens of the decoding streams
(each SSE chunk's arrival after the one before, from their second token on, while the long prompts are in) is the
lesson: its p50 and p99, colocated and apart; then the decode engine's counters (blocks and bytes received, prompt
tokens it computed). Greedy, EOS ignored; the decoding streams' texts are checked equal across the two setups.

    python docs/data/pd_latency.py > docs/data/raw/cpu_pd_latency.txt
    python docs/data/pd_latency.py --device cuda --model random:qwen3-0.6b --streams 64 --long 8 \
        --long-tokens 6000 --decode-tokens 512          # two GPUs: the producer on GPU 0, the consumer on GPU 1
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
MODEL, STREAMS, DECODE_TOKENS, LONG, LONG_TOKENS, GAP_S = "random:smollm2-135m", 6, 96, 3, 1200, 1.0


def start(script: str, *args, threads: int | None = None, gpu: int | None = None):
    sys.path.insert(0, str(ROOT))
    from steps.step35.parallel import free_port

    port = free_port()
    env = dict(os.environ, **({"OMP_NUM_THREADS": str(threads)} if threads else {}))
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = str(gpu)
    proc = subprocess.Popen([sys.executable, f"steps/step35/{script}", "--port", str(port), *args], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    for _ in range(1500):
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{script} did not start")


async def stream(client, base: str, i: int, gaps: list, window: list) -> str:
    body = {"model": MODEL, "prompt": f"Stream {i}: tell me a story about the number {i}.", "max_tokens": DECODE_TOKENS,
            "temperature": 0, "ignore_eos": True, "stream": True}
    text, last = "", None
    async with client.stream("POST", f"{base}/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            now = time.perf_counter()
            text += json.loads(line[6:])["choices"][0]["text"]
            if last is not None and window[0] is not None and window[0] <= now <= (window[1] or now):
                gaps.append(now - last)
            last = now
    return text


async def workload(base: str) -> tuple[list[float], list[str]]:
    gaps, window = [], [None, None]
    async with httpx.AsyncClient(timeout=None) as client:
        streams = [asyncio.create_task(stream(client, base, i, gaps, window)) for i in range(STREAMS)]
        await asyncio.sleep(1.0)  # every stream decoding
        window[0] = time.perf_counter()
        longs = []
        for j in range(LONG):
            prompt = " ".join(f"word{(j * 7919 + k) % 5000}" for k in range(LONG_TOKENS // 2))
            longs.append(asyncio.create_task(client.post(f"{base}/v1/completions", json={
                "model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True})))
            await asyncio.sleep(GAP_S)
        for r in await asyncio.gather(*longs):
            assert r.status_code == 200, r.text
        window[1] = time.perf_counter()
        texts = await asyncio.gather(*streams)
    return gaps, texts


def percentiles(gaps: list[float]) -> tuple[float, float]:
    q = statistics.quantiles(gaps, n=100)
    return 1000 * statistics.median(gaps), 1000 * q[98]


def main() -> None:
    global MODEL, STREAMS, DECODE_TOKENS, LONG, LONG_TOKENS
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--streams", type=int, default=STREAMS)
    parser.add_argument("--decode-tokens", type=int, default=DECODE_TOKENS)
    parser.add_argument("--long", type=int, default=LONG)
    parser.add_argument("--long-tokens", type=int, default=LONG_TOKENS)
    args = parser.parse_args()
    MODEL, STREAMS, DECODE_TOKENS, LONG, LONG_TOKENS = (args.model, args.streams, args.decode_tokens, args.long,
                                                        args.long_tokens)
    gpu = args.device == "cuda"
    engine = ["--model", MODEL, "--device", args.device, "--max-num-batched-tokens", "512",
              "--max-num-seqs", str(max(64, STREAMS + LONG))] + ([] if gpu else ["--max-kv-tokens", "16384"])
    results, procs = {}, []
    try:
        procs.append(start("serve.py", *engine, threads=None if gpu else os.cpu_count(), gpu=0 if gpu else None))
        results["colocated"] = asyncio.run(workload(procs[-1][1]))
        procs.pop()[0].terminate()
        producer = start("serve.py", *engine, "--kv-transfer-config", '{"kv_role": "kv_producer"}',
                         threads=None if gpu else 1, gpu=0 if gpu else None)
        consumer = start("serve.py", *engine, "--kv-transfer-config", '{"kv_role": "kv_consumer"}',
                         threads=None if gpu else 1, gpu=1 if gpu else None)
        procs += [producer, consumer]
        router = start("router.py", "--prefill", producer[1], "--decode", consumer[1])
        procs.append(router)
        results["apart"] = asyncio.run(workload(router[1]))
        counters = httpx.get(f"{consumer[1]}/stats", timeout=10).json()["engine"]
    finally:
        for proc, _ in procs:
            proc.terminate()
    where = "two GPUs" if gpu else f"this machine's CPU ({os.cpu_count()} cores)"
    print(f"{MODEL} on {where}: {STREAMS} streams decoding {DECODE_TOKENS} tokens, "
          f"{LONG} prompts of about {LONG_TOKENS} tokens arriving {GAP_S:.0f} s apart among them")
    print("setup                               time between tokens p50  p99      tokens timed")
    print("----------------------------------  -----------------------  -------  ------------")
    labels = {"colocated": "colocated, one engine on GPU 0" if gpu else f"colocated, one engine ({os.cpu_count()} threads)",
              "apart": "apart: GPU 0 + GPU 1" if gpu else "apart: producer + consumer (1 + 1)"}
    for name, (gaps, _) in results.items():
        p50, p99 = percentiles(gaps)
        print(f"{labels[name]:<34}  {p50:>20.1f} ms  {p99:>5.1f} ms  {len(gaps):>12}")
    ratio = percentiles(results["apart"][0])[1] / percentiles(results["colocated"][0])[1]
    print(f"p99 apart / colocated: {ratio:.2f}x")
    print(f"The decode engine received {counters['kv_received_blocks']} blocks ({counters['kv_received_bytes']:,} bytes) "
          f"in {counters['kv_loads']} transfers, {1000 * counters['kv_load_s'] / max(counters['kv_loads'], 1):.1f} ms "
          f"each on average, and computed {counters['remote_prompt_tokens_computed']} prompt tokens.")
    same = results["colocated"][1] == results["apart"][1]
    print("The decoding streams' texts are " + ("equal in both setups." if same else "NOT equal."))


if __name__ == "__main__":
    main()
