"""A serving benchmark against a running OpenAI-compatible server: requests arrive at random (a Poisson process) at
each given rate, each one streamed, and the latencies a user sees are measured, as `vllm bench serve` reports them.

    python steps/step27/bench_serve.py --base-url http://127.0.0.1:8000 --model smollm2-135m \\
        --request-rates 1 4 inf --num-prompts 64 --input-len 128 --output-len 64 --client-processes 4

The requests: --num-prompts prompts of --input-len random token ids (seeded), each asking for exactly --output-len
tokens (ignore_eos), greedy, through /v1/completions with "stream": true. Rate inf sends every request at once:
the server's saturation. Before the first rate, an untimed warm-up (--no-warmup skips it): one request alone, then
--num-prompts at once, of the same lengths but other token ids (nothing the measured runs send is in the prefix cache
from it), so that the server's first calls (its kernels compiled for each new shape, on a GPU) are not measured.
For each rate, one JSON line:

    request_throughput   completed requests per second of the run's wall time
    output_throughput    generated tokens per second (the tokens from each response's usage)
    ttft_ms              time to first token: from sending the request to its first chunk (a chunk holds new tokens;
                         their text may be empty, as for half of a character that takes two tokens)
    tpot_ms              time per output token after the first: (e2e - ttft) / (tokens - 1), per request
    itl_ms               inter-token latency: the gaps between a stream's chunks, all requests together
    e2e_ms               end-to-end latency: from sending to the last chunk
each latency as mean, p50, p90 and p99.

--client-processes N spreads the requests over N processes (the same arrival times): one Python process parsing a
few hundred event streams uses about a core, and then it, not the server, sets the pace. Events that reach the
client in one socket read get one timestamp, so part of the ITL gaps read 0.0 ("itl_zero_fraction"); the fewer
streams a process reads, the fewer such bursts.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `shared` importable
    # the root on the path, this folder off it: a module here (kernels/) would hide an installed one
    sys.path[:] = [str(Path(__file__).resolve().parents[2])] + [
        p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

from shared.stats import percentile  # noqa: E402


def percentiles(values: list[float]) -> dict:
    """mean, p50, p90, p99 (shared/stats.py's nearest rank), in ms; all None for no values."""
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    return {"mean": 1000 * statistics.fmean(values), **{f"p{round(100 * q)}": 1000 * percentile(values, q)
                                                        for q in (0.5, 0.9, 0.99)}}


def random_prompts(num: int, input_len: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000, 10000) for _ in range(input_len)] for _ in range(num)]


async def one_request(client, url: str, body: dict, headers: dict) -> dict:
    """One streamed completion -> its times (seconds from its start) and token count; "error" if it failed."""
    start = time.perf_counter()
    chunks, tokens = [], None
    try:
        async with client.stream("POST", url, json=body, headers=headers) as response:
            if response.status_code != 200:
                return {"error": f"HTTP {response.status_code}: {(await response.aread())[:300]!r}"}
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[len("data: "):])
                if "error" in data:
                    return {"error": data["error"]["message"]}
                if data.get("usage"):
                    tokens = data["usage"]["completion_tokens"]
                if data["choices"]:  # a chunk with a choice carries tokens, even if their text is empty (yet)
                    chunks.append(time.perf_counter() - start)
    except Exception as e:  # the server went away, a timeout: counted as failed, the run goes on
        return {"error": f"{type(e).__name__}: {e}"}
    end = time.perf_counter() - start
    if not chunks or tokens is None:
        return {"error": "no tokens or no usage in the stream"}
    return {"chunks": chunks, "e2e": end, "tokens": tokens}


async def _stream_all(base_url: str, model: str, prompts: list[list[int]], delays: list[float], output_len: int,
                      api_key: str | None, start_at: float) -> list[dict]:
    """Send prompts[i] delays[i] seconds after the wall-clock time start_at -> each request's result, with the
    wall-clock times it was sent and finished (so results from several processes line up)."""
    import httpx

    url = base_url.rstrip("/") + "/v1/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    # An idle connection is dropped after 1 s, before the server closes it (uvicorn: after 5 s): a request sent on
    # a connection the server is closing at that moment fails with a ReadError.
    limits = httpx.Limits(max_connections=len(prompts), max_keepalive_connections=len(prompts), keepalive_expiry=1.0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        async def arrive(prompt, delay):
            await asyncio.sleep(max(0.0, start_at + delay - time.time()))
            body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0,
                    "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
            sent = time.time()
            result = await one_request(client, url, body, headers)
            return {**result, "sent_at": sent, "done_at": time.time()}

        return await asyncio.gather(*(arrive(p, d) for p, d in zip(prompts, delays)))


def _client_process(args: tuple) -> tuple[list[dict], float]:
    """One client process's share (multiprocessing): its results and the CPU seconds it used."""
    cpu = time.process_time()
    results = asyncio.run(_stream_all(*args))
    return results, time.process_time() - cpu


async def bench(base_url: str, model: str, rate: float, prompts: list[list[int]], output_len: int,
                api_key: str | None = None, seed: int = 0, procs: int = 1) -> dict:
    """Every prompt at Poisson arrivals of `rate` per second (inf: all at once) -> the metrics of the run.

    procs > 1 spreads the requests over that many client processes (prompt i to process i % procs), each with the
    arrival times it would have had in one process, so that the client's own CPU (HTTP, SSE parsing: about one
    core for a few hundred streams) does not pace what it measures. "client_cpu_s" is the client's CPU seconds,
    all its processes together."""
    rng = random.Random(seed)
    delays, at = [], 0.0
    for _ in prompts:
        delays.append(at)
        at += rng.expovariate(rate) if math.isfinite(rate) else 0.0
    if procs <= 1:
        cpu = time.process_time()
        start = time.time()
        results = await _stream_all(base_url, model, prompts, delays, output_len, api_key, start)
        client_cpu = time.process_time() - cpu
    else:
        import concurrent.futures
        import multiprocessing

        with concurrent.futures.ProcessPoolExecutor(procs, mp_context=multiprocessing.get_context("spawn")) as pool:
            list(pool.map(time.sleep, [0.0] * procs))  # the processes are up (spawned, imported) before the clock
            start = time.time() + 0.2  # every process starts its requests from the same moment
            shares = [(base_url, model, prompts[i::procs], delays[i::procs], output_len, api_key, start)
                      for i in range(procs)]
            parts = await asyncio.get_running_loop().run_in_executor(None, lambda: list(pool.map(_client_process,
                                                                                                 shares)))
        results = [None] * len(prompts)
        for i, (part, _) in enumerate(parts):
            results[i::procs] = part
        client_cpu = sum(cpu for _, cpu in parts)
    duration = max(r["done_at"] for r in results) - start
    done = [r for r in results if "error" not in r]
    output = sum(r["tokens"] for r in done)
    itl = [b - a for r in done for a, b in zip(r["chunks"], r["chunks"][1:])]
    tpot = [(r["e2e"] - r["chunks"][0]) / (r["tokens"] - 1) for r in done if r["tokens"] > 1]
    return {"request_rate": rate if math.isfinite(rate) else "inf", "num_prompts": len(prompts),
            "completed": len(done), "failed": len(results) - len(done),
            "errors": sorted({r["error"] for r in results if "error" in r})[:3], "duration_s": duration,
            "request_throughput": len(done) / duration, "output_throughput": output / duration,
            # the prompt tokens of the requests that completed (a failed request's prompt is not counted)
            "total_token_throughput": (output + sum(len(p) for p, r in zip(prompts, results) if "error" not in r))
                                      / duration,
            "output_tokens": output, "ttft_ms": percentiles([r["chunks"][0] for r in done]),
            "tpot_ms": percentiles(tpot), "itl_ms": percentiles(itl), "e2e_ms": percentiles([r["e2e"] for r in done]),
            "client_processes": max(1, procs), "client_cpu_s": client_cpu,
            # events that reached the client in one read share a timestamp: their gap reads 0.0
            "itl_zero_fraction": sum(g == 0.0 for g in itl) / len(itl) if itl else None}


async def warm_up(base_url: str, model: str, prompts: list[list[int]], output_len: int,
                  api_key: str | None = None, procs: int = 1) -> None:
    """Untimed, before the measured rates: the first prompt alone (a batch of one, as a low rate starts), then every
    prompt at once (the saturation's batch), each asking for output_len tokens as the measured runs do. A server
    compiles its kernels on their first call for each shape; here those calls are made before any clock runs. Give
    it prompts of the measured ones' lengths but not the same ids (random_prompts with another seed), or the
    measured runs find them in the prefix cache. A warm-up request that fails is an error: the measured runs would
    fail the same way."""
    for batch in (prompts[:1], prompts):
        result = await bench(base_url, model, math.inf, batch, output_len, api_key, procs=procs)
        if result["failed"]:
            raise RuntimeError(f"warm-up: {result['failed']} of {len(batch)} requests failed: {result['errors']}")


def rate_arg(value: str) -> float:
    rate = float(value)
    if not rate > 0:
        raise argparse.ArgumentTypeError(f"a request rate must be > 0 (or inf), got {value}")
    return rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", required=True, help="the model name the server serves")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--request-rates", type=rate_arg, nargs="+", default=[1.0, float("inf")],
                        help="requests per second, Poisson arrivals; inf: all at once (default: 1 inf)")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--client-processes", type=int, default=1,
                        help="spread the requests over this many client processes (default: %(default)s)")
    parser.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                        help="an untimed warm-up before the first rate (default: on)")
    args = parser.parse_args()
    for name in ("num_prompts", "input_len", "output_len", "client_processes"):
        if getattr(args, name) < 1:
            parser.error(f"argument --{name.replace('_', '-')}: must be at least 1, got {getattr(args, name)}")
    prompts = random_prompts(args.num_prompts, args.input_len, args.seed)
    if args.warmup:
        print(f"warm-up: 1, then {len(prompts)} requests ...", file=sys.stderr, flush=True)
        warm = random_prompts(args.num_prompts, args.input_len, args.seed + 1)  # other ids, the same lengths
        asyncio.run(warm_up(args.base_url, args.model, warm, args.output_len, args.api_key, args.client_processes))
    for rate in args.request_rates:
        result = asyncio.run(bench(args.base_url, args.model, rate, prompts, args.output_len, args.api_key, args.seed,
                                   args.client_processes))
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
