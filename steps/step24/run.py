"""step24 demo: an OpenAI-compatible server. serve.py puts step23's streaming engine behind FastAPI and uvicorn:
/v1/completions and /v1/chat/completions (streamed as server-sent events or not), /v1/models, /health.

The server is started as its own process on a free loopback port (as `python steps/step24/serve.py` starts it). One
streamed request is shown as it travels on the wire; then bench_serve.py's benchmark runs at two request rates
(Poisson arrivals, and all at once), and the same requests go through the offline engine in this process, to see
what serving over HTTP costs. The server is stopped with SIGINT, as Ctrl-C stops it."""
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `steps.<this step>` and `shared` importable
    # the root on the path, this folder off it: a module here (kernels/) would hide an installed one
    sys.path[:] = [str(Path(__file__).resolve().parents[2])] + [
        p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
    __package__ = "steps." + Path(__file__).parent.name

import asyncio
import json
import signal
import subprocess
import time

from shared import SamplingParams
from shared.anatomy import anatomy_arg_parser, before_after, demo_options
from shared.cli import answer_question, format_table, print_header, user_errors

from .bench_serve import bench, random_prompts
from .engine import LLM
from .parallel import free_port

HERE = Path(__file__).resolve().parent


def main() -> None:
    parser = anatomy_arg_parser(__doc__)
    parser.add_argument("--rate", type=float, default=2.0, help="the lower request rate, per second (default: 2)")
    args = parser.parse_args()
    with user_errors(parser):  # bad input: one `error:` line, exit status 2
        llm = LLM(args.model, device=args.device, dtype=args.dtype, max_num_seqs=max(args.requests, 16),
                  **demo_options(args))
        print_header("step24: an OpenAI-compatible server", llm)
        answer_question(llm, args)
        show_lesson(llm, args)


def start_server(model: str, port: int, *options: str, serve_py: Path = HERE / "serve.py") -> subprocess.Popen:
    """serve.py (this step's, or another's) in its own process with these engine options; -> once /health answers."""
    import httpx

    cmd = [sys.executable, str(serve_py), "--model", model, "--port", str(port), *options]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"serve.py exited with status {proc.returncode}:\n{proc.stdout.read()[-3000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("serve.py did not answer /health within 600 s")


def server_options(args) -> list[str]:
    """This demo's engine options, as serve.py's flags."""
    options = ["--max-num-seqs", str(max(args.requests, 16))]
    for flag, value in (("--device", args.device), ("--dtype", args.dtype),
                        ("--gpu-memory-utilization", demo_options(args).get("gpu_memory_utilization"))):
        if value is not None:
            options += [flag, str(value)]
    return options


def show_lesson(llm, args) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    started = time.perf_counter()
    server = start_server(args.model, port, *server_options(args))
    print(f"\nserve.py answered /health after {time.perf_counter() - started:.1f} s: {' '.join(server.args[1:])}")
    try:
        show_wire(base, args.model)
        results = show_benchmark(llm, base, args)
    finally:
        server.send_signal(signal.SIGINT)  # Ctrl-C: uvicorn stops, its lifespan shuts the engine down
        try:
            code = server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            code = "killed after 60 s"
    print(f"\nThe server got SIGINT and exited with status {code}.")
    before_after("step23", "step24", llm, args)  # offline, the engine is step23's: the same requests, the same speed
    return results


def show_wire(base: str, model: str) -> None:
    """One short streamed chat request, as the bytes arrive: the SSE framing."""
    import httpx

    body = {"model": model, "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 4,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    def show(line: str) -> None:  # a long line in pieces of 110 characters, the later ones indented
        pieces = [line[i:i + 110] for i in range(0, len(line), 110)] or [""]
        print("\n".join(f"  {'' if k == 0 else '    '}{piece}" for k, piece in enumerate(pieces)))

    print("\nPOST /v1/chat/completions")
    show(json.dumps(body))
    print("the response body, line by line (text/event-stream):")
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=120) as response:
        for line in response.iter_lines():
            show(line)


def show_benchmark(llm, base: str, args) -> list[dict]:
    """bench_serve at --rate and at saturation, then the same requests through the offline engine."""
    prompts, output_len = random_prompts(args.requests, 64), args.lesson_tokens
    rows, results = [], []
    for rate in (args.rate, float("inf")):
        r = asyncio.run(bench(base, args.model, rate, prompts, output_len))
        results.append(r)
        if r["failed"]:
            raise RuntimeError(f"{r['failed']} request(s) failed at rate {rate}: {r['errors']}")
        rows.append([r["request_rate"], f"{r['request_throughput']:.2f}", f"{r['output_throughput']:.1f}",
                     *(latency(r[k]) for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"))])
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=2))  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    offline = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)
    print(f"\n{args.requests} requests, prompts of 64 random tokens, {output_len} new tokens each (greedy, streamed):\n"
          "bench_serve.py at two request rates (Poisson arrivals; inf: all at once). Latencies in ms, mean / p99:")
    print(format_table(["rate, req/s", "requests/s", "output tokens/s", "TTFT", "TPOT", "ITL", "E2E"], rows))
    saturated = results[-1]["output_throughput"]
    print(f"Offline, the same requests through LLM.generate in this process: {offline:.1f} output tokens/s.\n"
          f"At saturation the server made {saturated:.1f}: {saturated / offline:.2f}x the offline engine.")
    return results


def latency(ms: dict) -> str:
    """mean / p99 in ms; "-" where there is none (TPOT and ITL of answers of one token: no gap between tokens)."""
    return "-" if ms["mean"] is None else f"{ms['mean']:.1f} / {ms['p99']:.1f}"


if __name__ == "__main__":
    main()
