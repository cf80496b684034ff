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

Accepting, so that the outputs are exactly the target's (verify): at every place the target's own token is
computed as a plain decode step would compute it there (greedy: the argmax; sampling: a draw from p, the
distribution after temperature, min-p, top-k and top-p, with the random number a plain step uses for that place,
keyed by the request's seed and the token's position: sampler.py's uniforms). A draft passes while it equals that
token; at the first that does not, the target's token is emitted and the run ends; when every draft passes, the
last place gives a bonus token. For a sampled request this is the rejection rule for a draft that is a point mass on
x (Leviathan et al.; Chen et al.): x is accepted with probability p(x), and a rejection emits a token drawn from p
without x, renormalised. Every emitted token is the one the plain step would have drawn, so a seeded request gets
the same tokens with or without drafts, alone or in any batch, whatever decides how many drafts a step has.

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
        """-> up to k (default: the config's) draft tokens, [] when no n-gram of the last tokens occurs before."""
        k = self.k if k is None else k
        if k <= 0 or len(token_ids) - 1 < self.n_min:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        ends = match_ends(tokens, self.n_min, self.n_max)
        if ends is None:
            return []
        # the latest match that k tokens follow (the most recent context); if none has k after it (a loop matches
        # right behind the end), the earliest, which has the most
        full = ends[ends + 1 + k <= len(token_ids)]
        follow = int(full[-1] if len(full) else ends[0]) + 1  # the first draft's index
        return tokens[follow:follow + k].tolist()

    def may_propose(self, known: list[int], num_unknown: int) -> bool:
        """Could propose() find drafts once num_unknown more tokens (sampled on the device, not read yet: the
        sequence's placeholders) follow the known ones? A match of n tokens that ends at the last token starts with
        n - num_unknown known tokens that end at the newest known one and occur earlier, among known tokens. So when
        the last n_min - num_unknown known tokens occur nowhere before, no draft can come, whatever the unknown tokens
        are: -> False. True when they do (a draft may come), and always when num_unknown >= n_min (nothing known to
        rule one out)."""
        n = self.n_min - num_unknown
        if n < 1:
            return True
        if len(known) - 1 < n:
            return False
        return match_ends(np.asarray(known, dtype=np.int64), n, n) is not None


def match_ends(tokens: np.ndarray, n_min: int, n_max: int) -> np.ndarray | None:
    """Where the last n tokens occur earlier, for the longest n in n_min..n_max that does: the indices at which
    those earlier windows end (each before the last token), or None when no n >= n_min occurs before.

    One pass for every n at once: match[e] says that the j + 1 tokens ending at index e equal the last j + 1 tokens;
    it is narrowed one token further back each round (j = 0, 1, ..), so round n - 1 leaves the n-gram matches."""
    last = len(tokens) - 1
    match = tokens[:last] == tokens[last]  # [last]: windows of 1 token, by their end e
    ends = None  # the ends of the matches of the longest n >= n_min so far
    for j in range(min(n_max, last)):  # round j: windows of n = j + 1 tokens
        if j:
            match[j:] &= tokens[:last - j] == tokens[last - j]
            match[j - 1] = False  # a window of j + 1 tokens cannot end before index j
        longer = np.flatnonzero(match)
        if not len(longer):
            break
        if j + 1 >= n_min:
            ends = longer
    return ends


def verify(logits: torch.Tensor, seqs: list, drafts: list[list[int]], positions: list[int]):
    """The target's verdict on every request's drafts, computed on the device.

    logits: [T, vocab], each request's k_i + 1 rows in order (the row before draft j predicts draft j; the last row
    predicts the token after the last draft). positions[i]: the output index of request i's first draft.
    -> device tensors, one entry per row: target [T] (the token a plain step computes at that place: the argmax for
    a greedy request, else a draw from p with that place's plain key), accept [T] bool (the row's draft equals its
    target; False on a last row), target_logprob [T] (raw log-softmax, as a plain step reports it), and log_softmax
    [T, vocab] for the top-n logprobs."""
    device = logits.device
    draft_of, params_of, seeds_of, pos_of, last_of = [], [], [], [], []
    for seq, ds, pos in zip(seqs, drafts, positions):
        for j in range(len(ds) + 1):
            draft_of.append(ds[j] if j < len(ds) else -1)  # a last row has no draft: -1 equals no token
            params_of.append(seq.params)
            seeds_of.append(seq.seed)
            pos_of.append(pos + j)
            last_of.append(j == len(ds))
    draft_t = _to_device(torch.tensor(draft_of), device)  # [T]
    log_probs = torch.log_softmax(logits, dim=-1)  # [T, vocab]
    target = torch.argmax(logits, dim=-1)  # [T]: the greedy rows' token
    sampled = [r for r, sp in enumerate(params_of) if not sp.greedy]
    if sampled:  # the sampled rows: each place's plain draw (sampler.sample_batch's, row by row)
        index = _to_device(torch.tensor(sampled), device)
        p = processed_probs(logits[index], [params_of[r] for r in sampled])  # [S, vocab]
        u = _to_device(uniforms([seeds_of[r] for r in sampled], [pos_of[r] for r in sampled]), device)  # [S]
        target = target.index_put((index,), draw(p, u))
    accept = target == draft_t  # a last row's -1 never equals a token
    target_logprob = log_probs.gather(1, target[:, None])[:, 0]
    return accept, target, target_logprob, log_probs


def accepted_runs(accept: list[bool], target: list[int], target_lp: list[float],
                  drafts: list[list[int]]) -> list[tuple[list[int], list[float], list[int]]]:
    """Host side of verify: per request -> (the tokens to emit: the targets of the accepted rows, which are their
    drafts, then the target of the first rejected row or of the bonus row; their logprobs; the row each came
    from)."""
    out, row = [], 0
    for ds in drafts:
        tokens, lps, rows = [], [], []
        for j in range(len(ds) + 1):
            r = row + j
            tokens.append(target[r])
            lps.append(target_lp[r])
            rows.append(r)
            if not accept[r]:
                break
        out.append((tokens, lps, rows))
        row += len(ds) + 1
    return out
