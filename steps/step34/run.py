"""step34 demo: pipeline parallelism. The model's layers are cut into stages, one contiguous range each, and each
rank (stage x tensor-parallel rank) holds only its layers and their KV cache; the residual stream goes forward from
stage to stage by torch.distributed's point-to-point sends (gloo on the CPU, NCCL between GPUs), and the last stage
samples and sends the tokens back to rank 0, which schedules. Up to pipeline_parallel_size batches of distinct
requests are in flight, so stage 0 starts batch k + 1 while batch k is in a later stage. The lesson runs --requests
questions through the stages and shows the batches that overlapped, each stage's layers and KV bytes, its idle share
(the pipeline's bubbles, from recorded timestamps) and the bytes a token sends across a stage boundary against tensor
parallelism's all-reduces; then the same requests through step33 (one stage) and this step: the same tokens.

Under torchrun (`torchrun --nnodes 2 --node-rank R --master-addr A --nproc-per-node 1 steps/step34/run.py ...`) every
process runs this script: rank 0 is the engine and prints, every other rank serves its stage until rank 0 stops."""
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `steps.<this step>` and `shared` importable
    # the root on the path, this folder off it: a module here (kernels/) would hide an installed one
    sys.path[:] = [str(Path(__file__).resolve().parents[2])] + [
        p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
    __package__ = "steps." + Path(__file__).parent.name


from shared import SamplingParams
from shared.anatomy import QUESTIONS, anatomy_arg_parser, before_after, demo_options
from shared.cli import answer_question, format_table, print_header, user_errors


def main() -> None:
    parser = anatomy_arg_parser(__doc__)
    parser.set_defaults(requests=4, lesson_tokens=8)
    parser.add_argument("--pipeline-parallel-size", type=int, default=2, help="stages (default %(default)s)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="ranks per stage (default %(default)s)")
    parser.add_argument("--pp-layer-partition", default=None, help="each stage's layer count, as 6,5,5")
    args = parser.parse_args()
    with user_errors(parser):  # bad input: one `error:` line, exit status 2
        from .engine import LLM
        from .worker import torchrun_env
        options = dict(pipeline_parallel_size=args.pipeline_parallel_size, pp_layer_partition=args.pp_layer_partition,
                       tensor_parallel_size=args.tensor_parallel_size, async_scheduling=True,
                       max_num_seqs=max(1, args.requests // args.pipeline_parallel_size))
        env = torchrun_env()
        if env is not None and env["rank"] > 0:  # a stage's worker: it serves rank 0 until told to stop
            from .config import EngineConfig
            from .worker import run_torchrun_worker
            run_torchrun_worker(EngineConfig(model=args.model, device=args.device, dtype=args.dtype, **options,
                                             **demo_options(args)))
            return
        llm = LLM(args.model, device=args.device, dtype=args.dtype, **options, **demo_options(args))
        print_header("step34: pipeline parallelism, the layers in stages", llm)
        answer_question(llm, args)
        show_lesson(llm, args)
        llm.shutdown()


def show_lesson(llm, args) -> None:
    from .parallel import idle_shares

    sp = SamplingParams(temperature=0, max_tokens=args.lesson_tokens, ignore_eos=True)
    questions = [[{"role": "user", "content": q}] for q in (QUESTIONS * args.requests)[:args.requests]]
    core = llm.core
    core.launches.clear()
    mine, theirs = core.pipe.timeline, None
    mine.clear()
    before = {r["rank"]: len(r["timeline"]) for r in core.workers.stages()}
    llm.chat(questions, sp)
    reports = core.workers.stages()
    theirs = {r["rank"]: r for r in reports}
    layout = core.pipe.layout
    rows = [["0", "0", f"{core.model.config.layers.start}-{core.model.config.layers.stop - 1}",
             f"{core.runner.kv_cache.nbytes / 2**20:.2f}", str(core.pipe.bytes_sent), "0"]]
    for rank in range(1, layout.world):
        r = theirs[rank]
        rows.append([str(rank), str(r["stage"]), f"{r['layers'][0]}-{r['layers'][1] - 1}",
                     f"{r['kv_bytes'] / 2**20:.2f}", str(r["bytes_sent"]), str(r["bytes_received"])])
    print(format_table(["rank", "stage", "layers", "KV MiB", "bytes sent", "bytes received"], rows))
    # the batches: launched before the one before was read (overlap), and the most in flight at once
    launched, in_flight, most, overlapped = set(), 0, 0, 0
    for kind, number, _ in core.launches:
        if kind == "launch":
            overlapped += (number - 1) in launched  # the batch before it is still unread
            launched.add(number)
            in_flight += 1
            most = max(most, in_flight)
        else:
            launched.discard(number)
            in_flight -= 1
    batches = sum(kind == "launch" for kind, _, _ in core.launches)
    print(f"\n{batches} batches; {overlapped} launched on stage 0 while the batch before was in a later stage; at most "
          f"{most} in flight (the engine allows {core.depth}).")
    lines = [list(mine)] + [theirs[layout.rank(s, 0)]["timeline"][before.get(layout.rank(s, 0), 0):]
                            for s in range(1, layout.pp)]
    shares = idle_shares(lines)
    print("Each stage's idle share of the run (the pipeline's bubbles): " +
          ", ".join(f"stage {s} {share:.0%}" for s, share in enumerate(shares)))
    c, size = core.model.config, core.runner.dtype.itemsize
    print(f"\nA token crosses each stage boundary once: {c.hidden_size} x {size} bytes = {c.hidden_size * size} bytes "
          "(the residual stream).\n"
          f"Tensor parallelism over the same {c.num_layers} layers all-reduces it twice a layer: "
          f"{2 * c.num_layers * c.hidden_size * size} bytes a token on each rank.")
    before_after("step33", "step34", llm, args)  # one stage (step33) and these stages: the same tokens


if __name__ == "__main__":
    main()
