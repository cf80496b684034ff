"""The messages between the front end (async_llm.py's AsyncLLM, and serve.py around it) and the engine core
(engine_core.py), and nothing else: msgspec Structs, tagged, encoded as msgpack. Nothing is pickled: a frame either
decodes into one of these types or is an error. This module imports msgspec, the standard library, `shared` and
kv_spec.py only, never torch nor the engine, so that the front end, which imports it, runs without either.

    front end -> core   Add (a checked request: prompt ids and sampling parameters), Abort, GetStats
    core -> front end   Ready (the protocol version and the core's limits, once it is built), Outputs (a step's
                        Deltas), Stats, Error

PROTOCOL_VERSION names this set of messages. The core states it first in Ready, and the front end refuses a core
that states another (a front end and a core from two versions of the code would misread each other's frames): it
reads the version with ready_version() before it decodes the rest of the message, whose fields may be other ones.
Change it whenever a message changes.

An output is a delta: the token ids (and logprobs) a request got in this step, not a copy of all it has, so a
message's size does not grow with the output's length. Stop strings never cross the wire: the core checks EOS,
stop token ids and max_tokens (no text needed), and the front end, which decodes the text, finds the stop strings
and aborts the request in the core.
One step can give a request several tokens (a speculative run), and a stop string can end it before the
last of them; so a delta carries the cumulative logprob after each of its tokens, and the front end returns the
one after the last token it keeps.

Ready carries what the front end needs of the engine to check a request before it sends it (the vocabulary, the
model's context, the KV pool, max_logprobs); Stats carries the core's state on request (its queues, free blocks,
CPU time, the engine's own counters).
"""
from __future__ import annotations

from typing import Any

import msgspec

from shared import SamplingParams

PROTOCOL_VERSION = 2  # a Delta carries the cumulative logprob after each of its tokens


# ---- front end -> core ----------------------------------------------------------------------------------------
class Params(msgspec.Struct, array_like=True):
    """SamplingParams on the wire: every field but `stop` (stop strings stay in the front end)."""
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    max_tokens: int
    stop_token_ids: list[int]
    ignore_eos: bool
    seed: int | None
    logprobs: int | None

    @classmethod
    def of(cls, sp: SamplingParams) -> "Params":
        return cls(sp.temperature, sp.top_p, sp.top_k, sp.min_p, sp.max_tokens, list(sp.stop_token_ids or []),
                   sp.ignore_eos, sp.seed, sp.logprobs)

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                              max_tokens=self.max_tokens, stop_token_ids=self.stop_token_ids,
                              ignore_eos=self.ignore_eos, seed=self.seed, logprobs=self.logprobs)


class Add(msgspec.Struct, tag="add", array_like=True):
    request_id: str  # the front end's name for it in the core, never reused (not the caller's request id)
    prompt_ids: list[int]
    params: Params
    kv_transfer_params: dict[str, Any] | None = None  # prefill and decode apart (kv_connector.py)


class Abort(msgspec.Struct, tag="abort", array_like=True):
    request_ids: list[str]
    reply: int = 0  # not 0: the core answers with Stats(reply=...) once the blocks are free


class GetStats(msgspec.Struct, tag="get_stats", array_like=True):
    reply: int


# ---- core -> front end ----------------------------------------------------------------------------------------
class Delta(msgspec.Struct, array_like=True):
    """What one request got in one step: its new tokens only, and where they start in its output (so the front end
    takes only what it lacks, and a gap would show)."""
    request_id: str
    start: int  # the output index of token_ids[0]
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None  # one {token_id: logprob} per new token (top-N and the chosen one)
    cumulative_logprobs: list[float]  # one per new token, the request's cumulative logprob after it
    finish_reason: str | None = None  # "stop", "length", "abort", "error"
    stop_reason: int | None = None  # the stop token id that ended it
    error: str | None = None  # the step that served it failed: the request was dropped
    kv_transfer_params: dict[str, Any] | None = None  # a kv_producer's answer, on the delta that finishes it


class Outputs(msgspec.Struct, tag="outputs", array_like=True):
    deltas: list[Delta]


class Stats(msgspec.Struct, tag="stats", array_like=True):
    reply: int
    # counters; the time by phase (phase_s), CPU seconds by thread (threads_cpu_s), the engine's counters (engine)
    state: dict[str, int | float | dict[str, int | float]]


class Error(msgspec.Struct, tag="error", array_like=True):
    message: str
    fatal: bool = False  # the core's loop died, or never started: nothing is served any more
    kind: str = "RuntimeError"  # the exception's type: "ValueError" for a bad model or option (the caller's input)


class Ready(msgspec.Struct, tag="ready", array_like=True):
    """The core is built and serves: what the front end checks a request against before it sends it."""
    protocol: int  # PROTOCOL_VERSION of the core's code: first, so that another version's Ready still shows it
    vocab_size: int
    max_model_len: int  # the model's context, in tokens
    num_blocks: int  # the KV pool: num_blocks blocks of block_size tokens
    block_size: int
    max_logprobs: int  # the most logprobs a request may ask for (the engine's max_logprobs)


ToCore = Add | Abort | GetStats
FromCore = Outputs | Stats | Error | Ready


def ready_version(frame: bytes) -> int | None:
    """The protocol version a Ready frame states, read without decoding the rest (a Ready of another version may
    have other fields). None: the frame is no Ready."""
    try:
        raw = msgspec.msgpack.decode(frame)
    except msgspec.DecodeError:
        return None
    if isinstance(raw, list) and len(raw) >= 2 and raw[0] == "ready":
        return raw[1]
    return None


# ---- prefill and decode apart: a request's kv_transfer_params (kv_connector.py) ----------------------------------
REMOTE_PREFILL_KEYS = {"do_remote_prefill": bool, "remote_engine_id": str, "remote_host": str, "remote_port": int,
                       "remote_request_id": str, "remote_block_ids": list, "remote_num_tokens": int,
                       "output_token_ids": list, "output_logprobs": (list, type(None)),
                       "cumulative_logprob": (int, float)}


def check_transfer_params(params, role: str | None, prompt_len: int, block_size: int) -> dict | None:
    """A request's kv_transfer_params, checked against this engine's role: None, {"do_remote_decode": True} on a
    producer, or a producer's answer (with "do_remote_prefill": True) on a consumer. Anything else is a ValueError
    that names it."""
    if params is None:
        return None
    if role is None:
        raise ValueError("kv_transfer_params: this engine has no kv_transfer_config (it runs prefill and decode "
                         "itself); send them to a kv_producer or a kv_consumer")
    if not isinstance(params, dict):
        raise ValueError(f"kv_transfer_params must be a dict, got {type(params).__name__}")
    if role == "kv_producer":
        if params != {"do_remote_decode": True}:
            raise ValueError(f"kv_transfer_params on a kv_producer must be {{'do_remote_decode': true}}, got {params!r}")
        return params
    missing = [k for k in REMOTE_PREFILL_KEYS if k not in params]
    if missing or params.get("do_remote_prefill") is not True:
        raise ValueError(f"kv_transfer_params on a kv_consumer are a kv_producer's answer with do_remote_prefill "
                         f"true; missing {missing or ['do_remote_prefill: true']}")
    for key, kind in REMOTE_PREFILL_KEYS.items():
        if not isinstance(params[key], kind) or (kind is int and isinstance(params[key], bool)):
            raise ValueError(f"kv_transfer_params' {key} has the wrong type: {params[key]!r}")
    if params["remote_num_tokens"] != prompt_len:
        raise ValueError(f"kv_transfer_params: the producer computed {params['remote_num_tokens']} prompt tokens, this "
                         f"request's prompt has {prompt_len} (the same prompt must go to both engines)")
    if len(params["remote_block_ids"]) != -(-prompt_len // block_size):
        raise ValueError(f"kv_transfer_params: {len(params['remote_block_ids'])} remote blocks for a prompt of "
                         f"{prompt_len} tokens in blocks of {block_size}")
    if not params["output_token_ids"]:
        raise ValueError("kv_transfer_params: output_token_ids holds no token (the producer's first token)")
    return params
