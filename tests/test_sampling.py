"""The sampler: exact masks on hand-made logits, seeded reproducibility, and the draw itself."""
import importlib
import importlib.util
import math

import pytest
import torch

from conftest import STEPS, cached_llm
from helpers import copies_params
from shared import SamplingParams

SAMPLER_STEPS = [s for s in STEPS if importlib.util.find_spec(f"steps.{s}.sampler") is not None]
# The tests of sampler.py alone run once for each distinct content of the file (one file is copied into many
# steps); the tests that generate with an engine run in every step.
SAMPLER_COPIES = copies_params(SAMPLER_STEPS, "sampler")
NEG_INF = float("-inf")


def sampler(step):
    return importlib.import_module(f"steps.{step}.sampler")


def sample_one(s, logits, sp, seed, position) -> int:
    """One request's next token through the step's sampler: sample() where the step has it (step02-11), else
    sample_batch on a batch of one (step12 on, whose engines call nothing else)."""
    if hasattr(s, "sample_batch"):
        return int(s.sample_batch(logits[None], [sp], [seed], [position])[0])
    return s.sample(logits, sp, seed, position)


def kept(logits):
    return set(torch.isfinite(logits).nonzero().flatten().tolist())


def probs_logits(probs):
    return torch.log(torch.tensor(probs, dtype=torch.float32))


@pytest.mark.parametrize("step", SAMPLER_COPIES)
def test_top_k_mask_is_exact(step):
    s = sampler(step)
    logits = torch.tensor([1.0, 3.0, 2.0, 5.0, 4.0])
    assert kept(s.apply_top_k(logits, 1)) == {3}
    assert kept(s.apply_top_k(logits, 2)) == {3, 4}
    assert kept(s.apply_top_k(logits, 4)) == {1, 2, 3, 4}
    assert kept(s.apply_top_k(logits, -1)) == {0, 1, 2, 3, 4}  # disabled
    assert kept(s.apply_top_k(logits, 0)) == {0, 1, 2, 3, 4}  # disabled
    assert kept(s.apply_top_k(torch.tensor([2.0, 1.0, 2.0, 0.0]), 1)) == {0, 2}  # ties with the k-th are kept
    assert torch.equal(s.apply_top_k(logits, 2)[[3, 4]], logits[[3, 4]])  # survivors unchanged


@pytest.mark.parametrize("step", SAMPLER_COPIES)
def test_top_p_mask_is_exact(step):
    s = sampler(step)
    logits = probs_logits([0.15, 0.5, 0.05, 0.3])  # sorted: 1 (0.5), 3 (0.3), 0 (0.15), 2 (0.05)
    assert kept(s.apply_top_p(logits, 0.4)) == {1}
    assert kept(s.apply_top_p(logits, 0.79)) == {1, 3}
    assert kept(s.apply_top_p(logits, 0.81)) == {1, 3, 0}
    assert kept(s.apply_top_p(logits, 0.96)) == {0, 1, 2, 3}
    assert kept(s.apply_top_p(logits, 1.0)) == {0, 1, 2, 3}
    assert kept(s.apply_top_p(logits, 1e-6)) == {1}  # the most likely token always survives


@pytest.mark.parametrize("step", SAMPLER_COPIES)
def test_min_p_mask_is_exact(step):
    s = sampler(step)
    logits = probs_logits([0.5, 0.3, 0.15, 0.05])
    assert kept(s.apply_min_p(logits, 0.2)) == {0, 1, 2}  # threshold 0.1
    assert kept(s.apply_min_p(logits, 0.5)) == {0, 1}  # threshold 0.25
    assert kept(s.apply_min_p(logits, 1.0)) == {0}
    assert kept(s.apply_min_p(logits, 0.0)) == {0, 1, 2, 3}


@pytest.mark.parametrize("step", SAMPLER_COPIES)
def test_sample_follows_the_distribution(step):
    s = sampler(step)
    probs = [0.5, 0.3, 0.15, 0.05]
    sp = SamplingParams(temperature=1.0, seed=0)
    counts = torch.zeros(4)
    n = 4000
    for position in range(n):  # one request's draws: the same seed, position after position
        counts[sample_one(s, probs_logits(probs), sp, 0, position)] += 1
    freq = counts / n
    # 4000 draws: the standard error of each frequency is below 0.008; 0.04 is 5 standard errors.
    assert torch.allclose(freq, torch.tensor(probs), atol=0.04), freq
    # With top_k=2 only the two most likely tokens are ever drawn, in ratio 0.5 : 0.3.
    sp2 = SamplingParams(temperature=1.0, top_k=2)
    draws = [sample_one(s, probs_logits(probs), sp2, 1, position) for position in range(1000)]
    assert set(draws) == {0, 1}
    assert abs(draws.count(0) / 1000 - 0.5 / 0.8) < 0.06


@pytest.mark.parametrize("step", SAMPLER_COPIES)
def test_temperature_zero_is_argmax_and_low_temperature_approaches_it(step):
    s = sampler(step)
    logits = torch.tensor([0.1, 2.0, 1.9, -1.0])
    assert sample_one(s, logits, SamplingParams(temperature=0), 0, 0) == 1
    draws = {sample_one(s, logits, SamplingParams(temperature=0.01), 0, position) for position in range(50)}
    assert draws == {1}


@pytest.mark.parametrize("step", SAMPLER_STEPS)
def test_seeded_sampling_is_reproducible(step):
    llm = cached_llm(step, "random:tiny-llama")
    prompt = [[5, 17, 300, 42]]
    def run(seed):
        sp = SamplingParams(temperature=1.0, top_p=0.95, seed=seed, max_tokens=16, ignore_eos=True)
        return llm.generate(prompt, sp)[0].outputs[0].token_ids
    assert run(7) == run(7)
    assert run(7) != run(8)  # near-uniform random model: two seeds agreeing on 16 tokens is ~impossible
    greedy = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0].outputs[0]
    top1 = llm.generate(prompt, SamplingParams(temperature=1.0, top_k=1, seed=3, max_tokens=16, ignore_eos=True))
    assert top1[0].outputs[0].token_ids == greedy.token_ids  # top_k=1 sampling is greedy


@pytest.mark.parametrize("step", SAMPLER_STEPS)
def test_logprobs_are_normalised_and_include_the_chosen_token(step):
    llm = cached_llm(step, "random:tiny-llama")
    out = llm.generate([[5, 17, 300]], SamplingParams(temperature=1.0, seed=1, max_tokens=6, logprobs=3))[0].outputs[0]
    assert len(out.logprobs) == len(out.token_ids)
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert tok in lp and 3 <= len(lp) <= 4
        assert all(v <= 0 for v in lp.values())
    assert math.isclose(out.cumulative_logprob, sum(lp[t] for t, lp in zip(out.token_ids, out.logprobs)), rel_tol=1e-5)


@pytest.mark.parametrize("step", SAMPLER_COPIES)
def test_filters_run_in_vllms_order(step):
    """Temperature, then min-p, then top-k and top-p: top-p sees the probabilities left after min-p.
    Here min-p keeps {0, 1} (renormalised to 0.57 / 0.43) and top-p 0.5 then keeps only token 0; the old
    order (top-p on the original probabilities first) would keep token 1 too."""
    s = sampler(step)
    logits = probs_logits([0.4, 0.3, 0.2, 0.1])
    sp = SamplingParams(temperature=1.0, min_p=0.6, top_p=0.5, seed=0)
    assert {sample_one(s, logits, sp, s.request_seed(sp), position) for position in range(200)} == {0}


@pytest.mark.parametrize("step", SAMPLER_COPIES)
def test_draw_is_keyed_by_seed_and_position(step):
    """A draw's random number is a function of (seed, position) alone: the same key, the same number, in any
    order and whatever else is in the batch; different keys, numbers spread over [0, 1)."""
    s = sampler(step)
    seeds, positions = [7, 7, 8, -3, 2**40 + 7], [0, 1, 0, 0, 0]
    u = s.uniforms(seeds, positions)
    assert u.dtype == torch.float64 and bool(((u >= 0) & (u < 1)).all())
    assert len(set(u.tolist())) == len(seeds)  # every key its own number (the high half of a seed counts too)
    reversed_u = s.uniforms(seeds[::-1], positions[::-1])
    assert torch.equal(reversed_u.flip(0), u)
    assert torch.equal(s.uniforms([7], [1]), u[1:2])
    many = s.uniforms([123] * 20000, list(range(20000)))
    assert abs(float(many.mean()) - 0.5) < 0.01 and float(many.min()) < 1e-3 and float(many.max()) > 1 - 1e-3
    assert s.request_seed(SamplingParams(seed=5)) == 5
    assert s.request_seed(SamplingParams()) != s.request_seed(SamplingParams())  # unseeded: a fresh seed each


@pytest.mark.parametrize("step", SAMPLER_COPIES)
def test_inverse_cdf_draw_follows_a_wide_distribution(step):
    """The draw over a wide row of small probabilities, with filtered (zero-probability) tokens: a
    chi-square test on 20,000 draws over 8 bins of a 5,000-token distribution (7 degrees of freedom; 24.32 has
    a false-alarm rate of 1e-3, and the keys are fixed, so the test is deterministic). A token of probability
    zero is never drawn."""
    s = sampler(step)
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5_000, generator=gen) * 2
    logits[::7] = NEG_INF  # filtered tokens
    probs = torch.softmax(logits, dim=-1)
    u = s.uniforms([99] * 20_000, list(range(20_000)))  # one request's first 20,000 draws
    tokens = torch.cat([s.draw(probs.expand(2_000, -1), u[i:i + 2_000]) for i in range(0, 20_000, 2_000)])
    assert not bool((tokens % 7 == 0).any()), "a token of probability zero was drawn"
    order = torch.argsort(probs, descending=True)
    bins = torch.empty_like(order)
    bins[order] = torch.arange(len(order)) * 8 // len(order)  # 8 bins of tokens, most likely first
    expected = torch.zeros(8, dtype=torch.float64).index_add_(0, bins, probs.double()) * len(tokens)
    counts = torch.bincount(bins[tokens], minlength=8).double()
    keep = expected > 5  # bins with enough expected draws for the test
    chi2 = float(((counts - expected)[keep] ** 2 / expected[keep]).sum())
    assert chi2 < 24.32, f"chi-square {chi2:.1f}: counts {counts.tolist()} expected {expected.tolist()}"
