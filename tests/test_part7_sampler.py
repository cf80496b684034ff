"""step21: the sampler's draw as one Triton kernel (kernels/sampling.py) for the rows that ask for no filter.

The kernel gives sampler.py's tokens (the same keyed draw: the key hashed in the kernel, the same inverse-CDF
search) and log_softmax's logprobs, on rows mixing greedy and sampled requests, seeded and not, on a vocabulary
that is not a whole number of blocks and with tokens of probability 0 (Triton's interpreter on the CPU; compiled
on the GPU at Qwen3's vocabulary); the model runner takes it only when no row asks for a filter, and then gives
the torch path's tokens, logprobs and top logprobs, with the path it took counted."""
import importlib
from types import SimpleNamespace

import pytest
import torch

from helpers import copies_param
from registry import has, having, lesson_and_copies
from test_part6 import DEVICE

pytest.importorskip("triton")

from shared import SamplingParams  # noqa: E402

# the kernel's test runs once per distinct content of the files it loads; the lesson's copy gets more rows
KERNEL_CASES = [copies_param(group, lesson) for group, lesson in lesson_and_copies("fused_sampler", "kernels.sampling",
                                                                                   "sampler")]


def modules(step):
    return (importlib.import_module(f"steps.{step}.kernels.sampling"), importlib.import_module(f"steps.{step}.sampler"),
            importlib.import_module(f"steps.{step}.model_runner"), importlib.import_module(f"steps.{step}.timers"))


def case(rows: int, vocab: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen) * 4
    logits[0, vocab // 3:] = float("-inf")  # a row whose tail has probability 0
    logits[1, ::2] = float("-inf")  # every other token impossible
    temperature = torch.tensor([[0.6, 1.0, 0.0, 0.3, 1.7][i % 5] for i in range(rows)])
    seeds = [int(torch.randint(0, 2**62, (1,), generator=gen)) for _ in range(rows)]
    positions = [int(torch.randint(0, 5000, (1,), generator=gen)) for _ in range(rows)]
    return logits.to(DEVICE), temperature.to(DEVICE), seeds, positions


def reference(sampler, logits, temperature, seeds, positions):
    """sampler.py's path: the keyed draw of softmax(logits / T), argmax where T = 0."""
    cpu = logits.cpu()
    probs = torch.softmax(cpu / temperature.cpu().clamp(min=1e-2)[:, None], dim=-1)
    drawn = sampler.draw(probs, sampler.uniforms(seeds, positions))
    return torch.where(temperature.cpu() > 0, drawn, cpu.argmax(-1)), torch.log_softmax(cpu, -1)


@pytest.mark.parametrize("step,lesson", KERNEL_CASES)
def test_fused_draw_gives_the_torch_paths_tokens_and_logprobs(step, lesson):
    sampling, sampler, _, _ = modules(step)
    rows, vocab = ((24 if lesson else 6), 1000) if DEVICE == "cpu" else (256, 151936)
    logits, temperature, seeds, positions = case(rows, vocab)
    block = 128 if DEVICE == "cpu" else 8192  # several blocks, the last one partly past the vocabulary
    keys = sampling.draw_params(temperature.tolist(), seeds, positions).to(DEVICE)
    token, logprob = sampling.fused_draw(logits, keys, block=block)
    want, logprobs = reference(sampler, logits, temperature, seeds, positions)
    assert token.cpu().tolist() == want.tolist()
    torch.testing.assert_close(logprob.cpu(), logprobs.gather(1, want[:, None])[:, 0], rtol=1e-5, atol=1e-5)
    assert bool((logprobs.gather(1, token.cpu()[:, None]) > float("-inf")).all())  # never a token of probability 0
    # a row's token depends on its own logits and key only: alone, it is the same
    alone, _ = sampling.fused_draw(logits[3:4], keys[3:4], block=block)
    assert alone.item() == token[3].item()


def seqs_for(params, n, step):
    """n rows to sample, each with its params, seed and output index: as the plan's sampling holds them where the
    runner reads a plan (scheduler_output), else as the sequences the runner reads."""
    if has(step, "scheduler_output"):
        return [(params[i % len(params)], 7919 * i + 1, 3 * i) for i in range(n)]
    return [SimpleNamespace(params=params[i % len(params)], seed=7919 * i + 1, output_ids=[0] * (3 * i),
                            num_output_placeholders=0) for i in range(n)]


@pytest.mark.parametrize("step", having("fused_sampler"))
def test_the_runner_takes_the_kernel_only_without_filters(step):
    """The runner's two paths on the same logits: the same tokens, logprobs and top logprobs, and each step's path
    counted (the kernel for temperature and greedy rows; sampler.py as soon as one row asks for a filter)."""
    _, _, model_runner, timers = modules(step)
    device = torch.device(DEVICE)

    def runner(fused):
        r = model_runner.ModelRunner(None, device, torch.float32, timers.PhaseTimers(device), {"syncs": 0})
        r.fused_sampler = fused
        return r

    plain = [SamplingParams(temperature=0.8, max_tokens=8), SamplingParams(temperature=0, max_tokens=8),
             SamplingParams(temperature=1.2, max_tokens=8, logprobs=3, seed=5)]
    logits = torch.randn(6, 700, generator=torch.Generator().manual_seed(1)).to(device) * 3
    fused, torch_path = runner(True), runner(False)
    got = fused.sample(seqs_for(plain, 6, step), logits)
    want = torch_path.sample(seqs_for(plain, 6, step), logits)
    assert got[0] == want[0]
    torch.testing.assert_close(torch.tensor(got[1]), torch.tensor(want[1]), rtol=1e-5, atol=1e-5)
    assert [t and sorted(t) for t in got[2]] == [t and sorted(t) for t in want[2]]
    assert fused.draws == {"fused": 1, "torch": 0} and torch_path.draws == {"fused": 0, "torch": 1}
    filtered = plain + [SamplingParams(temperature=0.8, top_p=0.9, max_tokens=8)]
    fused.sample(seqs_for(filtered, 8, step), torch.randn(8, 700).to(device))
    assert fused.draws == {"fused": 1, "torch": 1}  # one row asked for top-p: the torch path for the step
    greedy = [SamplingParams(temperature=0, max_tokens=8)]
    assert fused.sample(seqs_for(greedy, 4, step), logits[:4])[0] == logits[:4].argmax(-1).tolist()
    if step in having("fused_projections"):  # step28: greedy only takes the kernel too (its first maximum)
        assert fused.draws == {"fused": 2, "torch": 1}
    else:
        assert fused.draws == {"fused": 1, "torch": 2}  # greedy only: one argmax
