"""step27: exact speculative decoding with n-gram drafts (prompt lookup).

A decode step computes one token per request, and at batch 1 on a GPU it reads every weight for that one token.
Speculation guesses several tokens and checks them all in one forward: a request with k drafts is a chunk of k + 1
query tokens (its newest token, then the drafts), which the mixed kernel already handles (causal inside the chunk).
The forward gives the target model's distribution at each of those places, so the guesses can be checked, and one
token more is known at the end: the first place where a guess is wrong gets the target's own token, and when every
guess is right the last place gives a bonus token. A step then emits 1 to k + 1 tokens for one forward.

Proposing (NgramProposer): the last n tokens of the request (prompt and output; n from prompt_lookup_max down to
prompt_lookup_min) are looked up earlier in the same tokens; the tokens that followed their latest earlier
occurrence with k tokens after it are the drafts (the earliest occurrence when none has k: in a loop the latest
match sits right behind the end), up to k of them. It costs no model: text that repeats itself (code being edited, a
passage being summarised, a list) is where it finds drafts. A request with no match decodes as usual in the step.

Accepting, so that the outputs are exactly the target's (verify):
- greedy: accept while the target's argmax equals the draft; the first mismatch emits the argmax. The tokens are the
  ones a plain greedy decode makes.
- sampling: the draft is a point mass on x. Accept it with probability p(x), p being the target's distribution
  after temperature, min-p, top-k and top-p, exactly as a plain step draws from. On a rejection, draw from p with x
  removed, renormalised. Each emitted token then follows p exactly (Leviathan et al.; Chen et al.). The random
  numbers are counter-based, keyed by the request's seed and the token's position (sampler.py's uniforms), with one
  salt for the accept test and one for the draw after a rejection: a seeded request gets the same tokens alone or
  in a batch, given the same drafts.

The KV of the rejected drafts: their slots were written by the forward. The engine counts as computed only the
newest token and the accepted drafts, and gives back the blocks past the request's tokens (block_manager.trim), so
the pool balances; the slots left in a kept block are overwritten later (nothing reads past a sequence's length).
Prefix-cache hashes are made after the drafts are gone: they cover accepted tokens only.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .sampler import _to_device, draw, processed_probs, uniforms

ACCEPT_SALT, RESIDUAL_SALT = 0x5EC0_0001, 0x5EC0_0002  # the accept test's and the residual draw's keys
# The engine's own disable_by_batch_size, when the config does not name one: from this many requests in the engine a
# step drafts nothing. On the H200 (docs/data/bench_spec.py --batch-sweep, qwen3-0.6b, drafting in every step),
# 1 and 2 requests at once were faster with drafts, 4 about even, 8 and more slower: a step that drafts runs
# synchronously, and its verify forward costs more as the batch grows, while the decodes it replaces overlap.
DISABLE_BY_BATCH_SIZE = 4


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's speculative_config for n-gram drafts: {"method": "ngram", "num_speculative_tokens": k,
    "prompt_lookup_max": 4, "prompt_lookup_min": 2}, plus "disable_by_batch_size" (vLLM's name too): no drafts in a
    step when at least that many requests are in the engine. Left out, it is DISABLE_BY_BATCH_SIZE; None: every step
    may draft (vLLM's default)."""

    num_speculative_tokens: int
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    disable_by_batch_size: int | None = DISABLE_BY_BATCH_SIZE
    method: str = "ngram"

    @classmethod
    def parse(cls, config) -> "SpeculativeConfig | None":
        """A dict (or None: no speculation) -> the checked config. ValueError names the field that is wrong."""
        if config is None:
            return None
        if not isinstance(config, dict):
            raise ValueError(f"speculative_config must be a dict or None, got {type(config).__name__}")
        known = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "disable_by_batch_size"}
        unknown = sorted(set(config) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown field {unknown[0]!r} (known: {', '.join(sorted(known))})")
        method = config.get("method")
        if method != "ngram":
            raise ValueError(f"speculative_config['method'] must be 'ngram' (the only method here), got {method!r}")
        if "num_speculative_tokens" not in config:
            raise ValueError("speculative_config['num_speculative_tokens'] is required (the drafts per step, k >= 1)")
        values = {}
        for name, default in (("num_speculative_tokens", None), ("prompt_lookup_max", 4), ("prompt_lookup_min", 2)):
            value = config.get(name, default)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"speculative_config[{name!r}] must be an int >= 1, got {value!r}")
            values[name] = value
        if values["prompt_lookup_min"] > values["prompt_lookup_max"]:
            raise ValueError(f"speculative_config['prompt_lookup_min'] ({values['prompt_lookup_min']}) must be <= "
                             f"prompt_lookup_max ({values['prompt_lookup_max']})")
        limit = config.get("disable_by_batch_size", DISABLE_BY_BATCH_SIZE)  # None, given: every step may draft
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
            raise ValueError(f"speculative_config['disable_by_batch_size'] must be an int >= 1 or None, got {limit!r}")
        return cls(disable_by_batch_size=limit, **values)


class NgramProposer:
    """Drafts from the request's own tokens: the continuation of an earlier occurrence of its last n tokens, the
    longest n first."""

    def __init__(self, config: SpeculativeConfig):
        self.k, self.n_max, self.n_min = config.num_speculative_tokens, config.prompt_lookup_max, config.prompt_lookup_min

    def propose(self, token_ids: list[int], k: int | None = None) -> list[int]:
        """-> up to k (default: the config's) draft tokens, [] when no n-gram of the last tokens occurs before.

        One pass over the tokens for every n at once: match[e] says that the j + 1 tokens ending at index e equal
        the last j + 1 tokens; it is narrowed one token further back each round (j = 0, 1, ..), so round n - 1
        leaves the n-gram matches. A window ends before the last token (e <= len - 2)."""
        k = self.k if k is None else k
        last = len(token_ids) - 1
        if k <= 0 or last < self.n_min:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        match = tokens[:last] == tokens[last]  # [last]: windows of 1 token, by their end e
        ends = None  # the ends of the matches of the longest n >= n_min so far
        for j in range(min(self.n_max, last)):  # round j: windows of n = j + 1 tokens
            if j:
                match[j:] &= tokens[:last - j] == tokens[last - j]
                match[j - 1] = False  # a window of j + 1 tokens cannot end before index j
            longer = np.flatnonzero(match)
            if not len(longer):
                break
            if j + 1 >= self.n_min:
                ends = longer
        if ends is None:
            return []
        # the latest match that k tokens follow (the most recent context); if none has k after it (a loop matches
        # right behind the end), the earliest, which has the most
        full = ends[ends + 1 + k <= len(token_ids)]
        follow = int(full[-1] if len(full) else ends[0]) + 1  # the first draft's index
        return tokens[follow:follow + k].tolist()


def verify(logits: torch.Tensor, seqs: list, drafts: list[list[int]], positions: list[int]):
    """The target's verdict on every request's drafts, computed on the device.

    logits: [T, vocab], each request's k_i + 1 rows in order (the row before draft j predicts draft j; the last row
    predicts the token after the last draft). positions[i]: the output index of request i's first draft.
    -> device tensors, one entry per row: accept [T] bool (the draft of that row passes; False on a last row),
    target [T] (the token to emit if the request stops at that row: the residual draw, or the argmax for greedy
    rows, or on a last row a plain draw), draft_logprob [T] and target_logprob [T] (raw log-softmax, as a plain
    step reports them), and log_softmax [T, vocab] for the top-n logprobs."""
    device, vocab = logits.device, logits.shape[-1]
    rows_of, draft_of, params_of, seeds_of, pos_of, last_of = [], [], [], [], [], []
    for i, (seq, ds, pos) in enumerate(zip(seqs, drafts, positions)):
        for j in range(len(ds) + 1):
            rows_of.append(i)
            draft_of.append(ds[j] if j < len(ds) else 0)
            params_of.append(seq.params)
            seeds_of.append(seq.seed)
            pos_of.append(pos + j)
            last_of.append(j == len(ds))
    draft_t, is_last = _to_device(torch.tensor([draft_of, last_of]), device)  # [T] each: one copy for both
    is_last = is_last.bool()
    log_probs = torch.log_softmax(logits, dim=-1)  # [T, vocab]
    draft_logprob = log_probs.gather(1, draft_t[:, None])[:, 0]
    greedy = [sp.greedy for sp in params_of]
    argmax = torch.argmax(logits, dim=-1)  # [T]
    accept = argmax == draft_t
    target = argmax
    sampled = [r for r, g in enumerate(greedy) if not g]
    if sampled:  # the rejection rule, on the sampled rows only
        index = _to_device(torch.tensor(sampled), device)
        p = processed_probs(logits[index], [params_of[r] for r in sampled])  # [S, vocab], as a plain step draws
        x = draft_t[index]
        seeds = [seeds_of[r] for r in sampled]
        pos = [pos_of[r] for r in sampled]
        u_accept = _to_device(uniforms([s ^ ACCEPT_SALT for s in seeds], pos), device)
        u_residual = _to_device(uniforms([s ^ RESIDUAL_SALT for s in seeds], pos), device)
        u_plain = _to_device(uniforms(seeds, pos), device)  # a last row: the key a plain step's draw has
        p_x = p.gather(1, x[:, None])[:, 0].double()
        ok = u_accept < p_x
        residual = p.scatter(1, x[:, None], 0.0)  # p without x (the draw renormalises: it scales by the total)
        last = is_last[index]
        drawn = torch.where(last, draw(p, u_plain), draw(residual, u_residual))
        accept = accept.index_put((index,), ok)
        target = target.index_put((index,), drawn)
    accept = accept & ~is_last
    target_logprob = log_probs.gather(1, target[:, None])[:, 0]
    return accept, target, draft_logprob, target_logprob, log_probs


def accepted_runs(accept: list[bool], target: list[int], draft_lp: list[float], target_lp: list[float],
                  drafts: list[list[int]]) -> list[tuple[list[int], list[float], list[int]]]:
    """Host side of verify: per request -> (the tokens to emit: the accepted drafts, then the target's token at the
    first rejected row or the bonus row; their logprobs; the row each came from)."""
    out, row = [], 0
    for ds in drafts:
        tokens, lps, rows = [], [], []
        for j in range(len(ds) + 1):
            r = row + j
            if j < len(ds) and accept[r]:
                tokens.append(ds[j])
                lps.append(draft_lp[r])
                rows.append(r)
                continue
            tokens.append(target[r])
            lps.append(target_lp[r])
            rows.append(r)
            break
        out.append((tokens, lps, rows))
        row += len(ds) + 1
    return out

