"""Speculative decoding with n-gram drafts (prompt lookup): its config, its proposer and its drafter, on the host.

A decode step computes one token per request, and at batch 1 on a GPU it reads every weight for that one token.
Speculation guesses several tokens and checks them all in one forward: a request with k drafts is a chunk of k + 1
query tokens (its newest token, then the drafts), which the mixed kernel already handles (causal inside the chunk).
The forward gives the target model's distribution at each of those places, so the guesses can be checked, and one
token more is known at the end: the first place where a guess is wrong gets the target's own token, and when every
guess is right the last place gives a bonus token. A step then emits 1 to k + 1 tokens for one forward.

Proposing (NgramProposer, here): the last n tokens of the request (prompt and output; n from prompt_lookup_max down
to prompt_lookup_min) are looked up earlier in the same tokens; the tokens that followed their latest earlier
occurrence with k tokens after it are the drafts (the earliest occurrence when none has k: in a loop the latest
match sits right behind the end), up to k of them. It costs no model: text that repeats itself (code being edited, a
passage being summarised, a list) is where it finds drafts. A request with no match decodes as usual in the step.

The rest lives where its kind of work lives. The verdict is device work, in the model runner (model_runner.py's
verify): every place is drawn exactly as a plain decode step draws there (the argmax, or the draw keyed by the
request's seed and the token's position), and a draft passes while it equals its place's token; for a sampled
request that is the rejection rule for a draft that is a point mass on x (Leviathan et al.; Chen et al.): x passes
with probability p(x), and a rejection emits a token that follows p without x, renormalised. So a seeded request
gets the same tokens with or without drafts, alone or in any batch. The rollback is bookkeeping, in the scheduler
(postprocess_verified): only the newest token and the accepted drafts count as computed, and the blocks past the
request's tokens go back to the pool (block_manager.trim); the slots left in a kept block are overwritten later
(nothing reads past a sequence's length), and prefix-cache hashes cover accepted tokens only.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

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


class Drafter:
    """What the core calls (drafting, propose, apply_verdicts): which steps draft, each request's drafts, and the
    verdicts' tokens taken into the requests, with the spec_* counters in the engine's stats. No config: no drafts."""

    def __init__(self, config: SpeculativeConfig | None, stats: dict, timers):
        self.config, self.stats, self.timers = config, stats, timers
        self.proposer = NgramProposer(config) if config is not None else None
        # drafts proposed and accepted; requests verified and the tokens they emitted; runs a stop cut short; steps
        # with drafts; steps without because of disable_by_batch_size, or because no request could get drafts
        stats.update(spec_proposed=0, spec_accepted=0, spec_verified=0, spec_emitted=0, spec_cut=0, spec_steps=0,
                     spec_disabled_steps=0, spec_undraftable_steps=0)

    def drafting(self, scheduler, overlapped: bool) -> bool:
        """Does this step draft? Not from disable_by_batch_size requests in the engine (running or waiting). And an
        overlapped step (async_scheduling) only if a running request may get drafts (may_propose: its newest token
        may be on the device); else it runs overlapped, as a step without drafts does."""
        if self.config is None:
            return False
        limit = self.config.disable_by_batch_size
        if limit is not None and len(scheduler.running) + len(scheduler.waiting) >= limit:
            self.stats["spec_disabled_steps"] += 1
            return False
        with self.timers.phase("schedule"):
            may = not overlapped or any(self.proposer.may_propose(seq.token_ids, seq.num_output_placeholders)
                                        for seq in scheduler.running)
        self.stats["spec_undraftable_steps"] += not may
        return may

    def propose(self, work, scheduler) -> dict[int, list[int]]:
        """-> {index in work: drafts} for the step's decodes: up to k each, within what is left of the token budget,
        what max_tokens leaves (a step emits at most drafts + 1) and the empty blocks (no one is preempted, no cached
        block evicted for a guess). Blocks are taken for their KV; they join token_ids for this step only."""
        bm, budget = scheduler.block_manager, scheduler.max_num_batched_tokens - sum(n for _, n in work)
        spec = {}
        with self.timers.phase("schedule"):  # proposing is host work of the schedule
            for i, (seq, n) in enumerate(work):
                if budget <= 0:
                    break
                if n != 1 or seq.num_computed_tokens + 1 != seq.num_tokens:  # a prompt chunk: no drafts
                    continue
                k = min(self.config.num_speculative_tokens, budget, seq.params.max_tokens - len(seq.output_ids) - 1)
                drafts = self.proposer.propose(seq.token_ids, k) if k > 0 else []
                # empty blocks only: a draft never evicts a cached block (a rejection would hand it back empty)
                while drafts and not bm.can_allocate_empty(seq, seq.num_tokens + len(drafts)):
                    drafts.pop()
                if not drafts:
                    continue
                bm.allocate(seq, seq.num_tokens + len(drafts))
                seq.add_drafts(drafts)  # taken out again by apply_verdicts
                spec[i] = drafts
                budget -= len(drafts)
                self.stats["spec_proposed"] += len(drafts)
        if spec:
            self.stats["spec_steps"] += 1
        return spec

    def apply_verdicts(self, spec: dict[int, list[int]], scheduled: list, verdicts: list, record, scheduler) -> None:
        """The runner's verdicts (its verify), per request: the drafts leave its tokens, the tokens the verdict emits
        are recorded (record: through the stop checks) one place at a time across the requests, so a stop inside a
        run ends it there, and the scheduler rolls the rejected drafts back (postprocess_verified)."""
        index = sorted(spec)
        seqs, drafts = [scheduled[i] for i in index], [spec[i] for i in index]
        for seq, ds, verdict in zip(seqs, drafts, verdicts):
            seq.drop_drafts(len(ds))  # the accepted ones come back below, recorded as tokens
            self.stats["spec_verified"] += 1
            self.stats["spec_accepted"] += len(verdict.tokens) - 1
        recorded = [0] * len(seqs)
        for j in range(max(len(v.tokens) for v in verdicts)):  # the j-th token of every run, through the stop checks
            live = [i for i, (seq, v) in enumerate(zip(seqs, verdicts)) if len(v.tokens) > j and seq.finish is None]
            if not live:
                break
            record([seqs[i] for i in live], [verdicts[i].tokens[j] for i in live],
                   [verdicts[i].logprobs[j] for i in live], [verdicts[i].tops[j] for i in live])
            for i in live:
                recorded[i] += 1
        self.stats["spec_cut"] += sum(n < len(v.tokens) for n, v in zip(recorded, verdicts))  # a stop inside a run
        self.stats["spec_emitted"] += sum(recorded)  # the tokens returned: none past a stop
        with self.timers.phase("schedule"):
            scheduler.postprocess_verified([(seq, len(v.tokens)) for seq, v in zip(seqs, verdicts)])


def describe_speculation(spec: SpeculativeConfig | None, cuda_graphs: dict) -> str:
    """The engine line's part for speculative decoding: the drafts, and how their verify steps run; or off."""
    if spec is None:
        return "speculative decoding: off"
    verify_sizes = cuda_graphs.get("verify_sizes")
    verify_graphs = (f"verify steps of up to {verify_sizes[-1]} requests replayed from {len(verify_sizes)} graphs "
                     f"of {cuda_graphs['verify_query_len']} tokens per row, larger ones eager"
                     if verify_sizes else "verify steps eager")
    off = f", off from {spec.disable_by_batch_size} running requests" if spec.disable_by_batch_size else ""
    return (f"speculative decoding: ngram, up to {spec.num_speculative_tokens} drafts "
            f"(lookup {spec.prompt_lookup_max}..{spec.prompt_lookup_min} tokens{off}), {verify_graphs}")
