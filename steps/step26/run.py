"""step26 demo. For now it is step25's (overlap scheduling); the lesson of the core process comes with the
chapter. With async_scheduling the engine launches step N + 1 on the device before it
reads step N's sampled tokens, so the host's work of a step (reading the tokens, stop checks, outputs, scheduling
and preparing the next step) runs while the device computes. The sampled tokens the host has not read stay on the
device (a token per block-table row), and the next step's inputs take them from there.

The demo's engine runs with async_scheduling=True (on a CPU too: there the order is the same, on one stream, and
nothing overlaps). The same requests go through step24 and this step, alternated; on CUDA the GPU's busy share is
measured from a profiler trace with async scheduling off and on."""
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

from .engine import LLM


def main() -> None:
    parser = anatomy_arg_parser(__doc__)
    args = parser.parse_args()
    with user_errors(parser):  # bad input: one `error:` line, exit status 2
        llm = LLM(args.model, device=args.device, dtype=args.dtype, max_num_seqs=max(args.requests, 16),
                  async_scheduling=True, **demo_options(args))
        print_header("step26: the engine core in its own process", llm)
        answer_question(llm, args)
        show_lesson(llm, args)


def show_lesson(llm, args) -> None:
    counts = {name: llm.stats[name] for name in ("discarded_tokens", "overlapped_launches", "forwards")}
    before_after("step24", "step26", llm, args)  # step24 reads every step's tokens before it schedules the next
    new = {name: llm.stats[name] - counts[name] for name in counts}
    print(f"\nstep26 ran with async_scheduling={llm.async_scheduling}. Over those runs: {new['discarded_tokens']} "
          "tokens computed for requests already at their end, thrown away and never emitted (a request runs one step "
          f"past its last token); {new['overlapped_launches']} of {new['forwards']} launches began while the step "
          "before still ran on the device.")
    if llm.device.type != "cuda":
        print("On a CPU there is one stream and the host is the device: a launch runs to its end before the host "
              "goes on, so nothing overlaps. The order is the same as on a GPU, and the outputs are checked.")
        return
    rows = []
    for mode in (False, True):
        share, steps = gpu_busy_share(llm, args, mode)
        rows.append([f"async_scheduling={mode}", f"{100 * share:.1f}%", steps])
    llm.async_scheduling = True
    print(f"\nThe GPU's busy share, {args.requests} requests x {args.lesson_tokens} new tokens (a torch.profiler "
          "trace: the time some kernel runs, over the time from the first kernel's start to the last one's end):")
    print(format_table(["mode", "GPU busy", "engine steps"], rows))


def gpu_busy_share(llm, args, async_scheduling: bool) -> tuple[float, int]:
    """One run of the demo's requests with async_scheduling on or off (the engine reads the flag at each step;
    it is switched only when nothing is in flight), under torch.profiler. -> (the share of the GPU's timeline in
    which a kernel runs, the engine steps)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    while llm.has_unfinished_requests():  # nothing in flight before the mode changes
        llm.step()
    llm.async_scheduling = async_scheduling
    conversations = [[{"role": "user", "content": q}] for q in (QUESTIONS * (args.requests // len(QUESTIONS) + 1))]
    params = SamplingParams(temperature=0, max_tokens=args.lesson_tokens, ignore_eos=True)
    llm.chat(conversations[:1], SamplingParams(temperature=0, max_tokens=2))  # warm-up
    steps = llm.timers.steps
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        llm.chat(conversations[:args.requests], params)
        torch.cuda.synchronize()
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    if not spans:
        return 0.0, llm.timers.steps - steps
    busy, start, end = 0.0, *spans[0]
    for s, e in spans[1:]:  # the union of the kernels' intervals
        if s > end:
            busy, start = busy + end - start, s
        end = max(end, e)
    busy += end - start
    return busy / max(max(e for _, e in spans) - spans[0][0], 1e-9), llm.timers.steps - steps


if __name__ == "__main__":
    main()
