"""Prefill and decode on separate engines: the KV connector between them (vLLM's split: a scheduler side that says how
many of a request's prompt tokens the other engine holds and which blocks receive them, a worker side that moves the
blocks by block id, layer by layer).

Two roles (kv_transfer_config's kv_role, vLLM's names):

    kv_producer   the prefill engine. A request sent with kv_transfer_params {"do_remote_decode": true} runs its
                  prompt and samples its first token (the router asks for max_tokens 1); when it finishes, its blocks
                  are not freed but lent (KVProducer.hold: a lease of kv_lease_s seconds), and its output carries the
                  kv_transfer_params a consumer needs: where to ask (host, port, engine id), the request's id there,
                  its block ids, its prompt's length, and the first token with its logprobs.
    kv_consumer   the decode engine. A request sent with those params (and "do_remote_prefill": true) starts with the
                  first token as its output; once the scheduler gives it blocks, the prompt's blocks that its own
                  prefix cache does not already hold are pulled from the producer into them (KVConsumer.start_load,
                  on a thread of its own: the engine's steps go on meanwhile), and the request then decodes from the
                  first token: the prompt's forward never runs here. Its draws are keyed by (seed, position) as on one
                  engine, so its tokens are one engine's.

The transport. A side channel, ZMQ + msgpack as the engine core's own messages: the consumer says hello (its engine
id, model, block size and cache row, checked against the producer's: a mismatch is refused with both named), then for
each request "pull" (the request id and the blocks it wants, by index into the lease's blocks) and, once written,
"ack" (the producer frees the blocks). The bytes go by torch.distributed point-to-point, gloo on the CPU (NCCL between
GPUs would take the same calls), over a group of two made for each producer-consumer pair at the hello (its own store:
no engine's default group is touched). Per layer, each cache tensor's rows of the blocks: the producer gathers them
and sends, the consumer receives and scatters them into its own blocks, in the order asked.

Failures. A lease that expires before its ack frees the blocks (the consumer's pull then gets an error); a pull that
fails (the producer gone, a refused handshake, an expired lease) is kv_load_failure_policy's (vLLM's name):
"recompute", the consumer runs the prompt itself; "fail", the request ends with an error. A request aborted while its
blocks arrive keeps them until the transfer has ended (a block freed under a write could be handed to another request).
"""
from __future__ import annotations

import queue
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import timedelta

import msgspec
import torch
import zmq

from .wire import check_transfer_params  # noqa: F401  (the core reads it from here)

ROLES = ("kv_producer", "kv_consumer")
POLICIES = ("recompute", "fail")


@dataclass
class KVTransferConfig:
    """kv_transfer_config (vLLM's option), as a dict: {"kv_role": "kv_producer" | "kv_consumer", "kv_host", "kv_port"
    (the producer's side channel; port 0: a free one), "kv_lease_s" (how long a producer lends a finished request's
    blocks), "kv_timeout_s" (a side-channel answer or a transfer that takes longer has failed), "kv_load_failure_policy"
    ("recompute" or "fail"), "engine_id"}."""

    kv_role: str
    kv_host: str = "127.0.0.1"
    kv_port: int = 0
    kv_lease_s: float = 30.0
    kv_timeout_s: float = 30.0
    kv_load_failure_policy: str = "recompute"
    engine_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])

    @classmethod
    def parse(cls, value) -> "KVTransferConfig | None":
        """None, a KVTransferConfig, or a dict of its fields -> a checked KVTransferConfig (None: no transfer)."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"kv_transfer_config must be a dict (as vLLM takes it), got {value!r}")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"kv_transfer_config: unknown key(s) {unknown}; known: {sorted(known)}")
        if value.get("kv_role") not in ROLES:
            raise ValueError(f"kv_transfer_config's kv_role must be one of {list(ROLES)}, got {value.get('kv_role')!r}")
        config = cls(**value)
        if isinstance(config.kv_port, bool) or not isinstance(config.kv_port, int) or not 0 <= config.kv_port < 65536:
            raise ValueError(f"kv_transfer_config's kv_port must be a port number (0: a free one), got {config.kv_port!r}")
        for name in ("kv_lease_s", "kv_timeout_s"):
            value = getattr(config, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"kv_transfer_config's {name} must be a positive number of seconds, got {value!r}")
        if config.kv_load_failure_policy not in POLICIES:
            raise ValueError(f"kv_transfer_config's kv_load_failure_policy must be one of {list(POLICIES)}, got "
                             f"{config.kv_load_failure_policy!r}")
        return config


def cache_tensors(kv_cache) -> list[torch.Tensor]:
    """The tensors of a KV cache whose rows a block's tokens own: [kinds, layers, blocks, ...] each (the K/V data, and
    an int8 cache's scales)."""
    return [kv_cache.data] + ([kv_cache.scales] if kv_cache.scales is not None else [])


def identity_of(kv_cache, model: str, block_size: int) -> dict:
    """What both sides must agree on before a block moves: the model, the block size and the cache's row."""
    return {"model": model, "block_size": block_size,
            "cache": [[list(t.shape[:2]) + list(t.shape[3:]), str(t.dtype)] for t in cache_tensors(kv_cache)]}


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def make_group(host: str, port: int, rank: int, timeout_s: float, device: torch.device):
    """A group of two (rank 0: the producer, which hosts the store) for one producer-consumer pair, apart from any
    default group: gloo between host memories, NCCL between GPUs (each engine's cache on its own GPU)."""
    import torch.distributed as dist

    store = dist.TCPStore(host, port, 2, rank == 0, timeout=timedelta(seconds=timeout_s))
    if device.type == "cuda":
        torch.cuda.set_device(device)  # this thread's device: the communicator's
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timedelta(seconds=timeout_s)
        return dist.ProcessGroupNCCL(store, rank, 2, options), store
    return dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=timeout_s)), store


@dataclass
class Lease:
    seq: object  # the finished request, its blocks still held
    blocks: list[int]  # its prompt's blocks, in order
    expires: float
    busy: bool = False  # a pull is sending them: not freed before it ends


class KVProducer:
    """The prefill engine's side: its leases and the side-channel thread that serves pulls. Everything that touches
    the block manager runs on the engine's thread (poll); the thread only reads leased blocks and queues events."""

    def __init__(self, config: KVTransferConfig, kv_cache, identity: dict, stats: dict):
        self.config, self.kv_cache, self.identity, self.stats = config, kv_cache, identity, stats
        stats.update(kv_sent_bytes=0, kv_sent_blocks=0, kv_leases=0, kv_leases_expired=0, kv_leases_acked=0,
                     kv_pulls_refused=0)
        self.leases: dict[str, Lease] = {}
        self.lock = threading.Lock()
        self.events: queue.SimpleQueue = queue.SimpleQueue()  # ("release", request id) for the engine's thread
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.port = config.kv_port or free_port(config.kv_host)
        self.sock.bind(f"tcp://{config.kv_host}:{self.port}")
        self.groups: dict[bytes, object] = {}
        self.closed = False
        self.thread = threading.Thread(target=self._serve, name="kv producer", daemon=True)
        self.thread.start()

    def hold(self, seq, block_size: int) -> dict:
        """A finished request's prompt blocks, lent for kv_lease_s: -> the kv_transfer_params its output carries."""
        prompt_len = len(seq.prompt_ids)
        blocks = list(seq.block_table[:-(-prompt_len // block_size)])
        with self.lock:
            self.leases[seq.request_id] = Lease(seq, blocks, time.monotonic() + self.config.kv_lease_s)
        self.stats["kv_leases"] += 1
        return {"do_remote_prefill": True, "remote_engine_id": self.config.engine_id,
                "remote_host": self.config.kv_host, "remote_port": self.port, "remote_request_id": seq.request_id,
                "remote_block_ids": blocks, "remote_num_tokens": prompt_len,
                "output_token_ids": list(seq.output_ids),
                "output_logprobs": [{str(k): v for k, v in top.items()} for top in seq.logprobs]
                if seq.logprobs is not None else None,
                "cumulative_logprob": seq.cumulative_logprob}

    def poll(self, release) -> None:
        """On the engine's thread: free the blocks of every lease acknowledged or expired (release(seq))."""
        done = []
        while True:
            try:
                done.append(self.events.get_nowait()[1])
            except queue.Empty:
                break
        now = time.monotonic()
        with self.lock:
            expired = [rid for rid, lease in self.leases.items() if lease.expires < now and not lease.busy]
            freed = [self.leases.pop(rid) for rid in dict.fromkeys(done + expired) if rid in self.leases]
        for lease in freed:
            release(lease.seq)
            self.stats["kv_leases_expired"] += lease.seq.request_id not in done

    @property
    def num_leases(self) -> int:
        return len(self.leases)

    def _serve(self) -> None:
        decoder, encoder = msgspec.msgpack.Decoder(), msgspec.msgpack.Encoder()
        while not self.closed:
            try:
                if not self.sock.poll(200):
                    continue
                frames = self.sock.recv_multipart()  # [the consumer's identity, b"" (REQ's delimiter), the message]
                who, body = frames[0], frames[-1]
            except zmq.ZMQError:
                return
            msg = decoder.decode(body)
            try:
                self._handle(who, msg, encoder)
            except Exception as e:  # noqa: BLE001 (an answer that says why; the channel serves on)
                self.stats["kv_pulls_refused"] += 1
                self.sock.send_multipart([who, b"", encoder.encode({"error": f"{type(e).__name__}: {e}"})])

    def _handle(self, who: bytes, msg: dict, encoder) -> None:
        kind = msg.get("kind")
        if kind == "hello":
            mismatch = [f"{key}: the producer's {self.identity[key]!r}, the consumer's {msg['identity'].get(key)!r}"
                        for key in self.identity if msg["identity"].get(key) != self.identity[key]]
            if mismatch:
                raise ValueError("the two engines do not match: " + "; ".join(mismatch))
            store_port = free_port(self.config.kv_host)
            self.sock.send_multipart([who, b"", encoder.encode({"ok": True, "engine_id": self.config.engine_id,
                                                           "store_port": store_port})])
            self.groups[who] = make_group(self.config.kv_host, store_port, 0, self.config.kv_timeout_s,
                                          self.kv_cache.data.device)  # (group, its store)
        elif kind == "pull":
            self._pull(who, msg["request_id"], msg["first"], msg["blocks"], encoder)
        elif kind == "ack":
            self.events.put(("release", msg["request_id"]))
            self.stats["kv_leases_acked"] += 1
            self.sock.send_multipart([who, b"", encoder.encode({"ok": True})])
        else:
            raise ValueError(f"unknown message kind {kind!r}")

    def _pull(self, who: bytes, request_id: str, first: int, blocks: list[int], encoder) -> None:
        """Send the request's lent blocks from its first-th on, the block ids the consumer names (its
        kv_transfer_params' remote_block_ids: they must be the lease's own), each cache tensor layer by layer."""
        count = len(blocks)
        if who not in self.groups:
            raise ValueError("pull before hello")
        group = self.groups[who][0]
        with self.lock:
            lease = self.leases.get(request_id)
            if lease is None:
                raise ValueError(f"no lease for request {request_id!r} (never held here, acknowledged, or expired "
                                 f"after {self.config.kv_lease_s} s)")
            if first < 0 or count < 1 or first + count > len(lease.blocks):
                raise ValueError(f"request {request_id!r} holds {len(lease.blocks)} blocks; blocks {first} .. "
                                 f"{first + count - 1} were asked for")
            if lease.blocks[first:first + count] != blocks:
                raise ValueError(f"request {request_id!r}'s blocks {first} .. {first + count - 1} are "
                                 f"{lease.blocks[first:first + count]}, not the {blocks} asked for")
            lease.busy = True
        try:
            self.sock.send_multipart([who, b"", encoder.encode({"ok": True})])
            index = torch.tensor(lease.blocks[first:first + count])
            for t in cache_tensors(self.kv_cache):
                for layer in range(t.shape[1]):
                    rows = t[:, layer].index_select(1, index.to(t.device)).contiguous()
                    group.send([rows], 1, 0).wait()
                    if rows.is_cuda:
                        torch.cuda.current_stream(rows.device).synchronize()  # sent before the buffer goes
                    self.stats["kv_sent_bytes"] += rows.numel() * rows.element_size()
            self.stats["kv_sent_blocks"] += count
        finally:
            with self.lock:
                lease.busy = False

    def close(self) -> None:
        self.closed = True
        self.thread.join(timeout=2)
        self.sock.close(linger=0)
        self.ctx.term()


class KVConsumer:
    """The decode engine's side: a link per producer (its side channel and its group of two), and a thread per
    transfer that writes the blocks into this engine's cache and queues what happened for the engine's thread."""

    def __init__(self, config: KVTransferConfig, kv_cache, identity: dict, stats: dict):
        self.config, self.kv_cache, self.identity, self.stats = config, kv_cache, identity, stats
        stats.update(kv_received_bytes=0, kv_received_blocks=0, kv_loads=0, kv_load_failures=0, kv_load_s=0.0)
        self.ctx = zmq.Context()
        self.links: dict[tuple, tuple] = {}  # (host, port) -> (socket, group, lock, the group's store)
        self.links_lock = threading.Lock()
        self.events: queue.SimpleQueue = queue.SimpleQueue()  # ("loaded" | "failed", request id, detail)
        self.threads: list[threading.Thread] = []

    def start_load(self, request_id: str, params: dict, first: int, local_blocks: list[int]) -> None:
        """Pull the remote blocks first .. first + len(local_blocks) - 1 of the producer's lease into local_blocks,
        on a thread of its own."""
        t = threading.Thread(target=self._load, args=(request_id, params, first, local_blocks), daemon=True,
                             name=f"kv load {request_id}")
        self.threads = [thread for thread in self.threads if thread.is_alive()] + [t]
        t.start()

    def poll(self) -> list[tuple]:
        out = []
        while True:
            try:
                out.append(self.events.get_nowait())
            except queue.Empty:
                return out

    def _link(self, host: str, port: int):
        with self.links_lock:
            link = self.links.get((host, port))
            if link is None:
                sock = self.ctx.socket(zmq.REQ)
                sock.setsockopt(zmq.RCVTIMEO, int(self.config.kv_timeout_s * 1000))
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(f"tcp://{host}:{port}")
                answer = self._ask(sock, {"kind": "hello", "identity": self.identity})
                group, store = make_group(host, answer["store_port"], 1, self.config.kv_timeout_s,
                                          self.kv_cache.data.device)
                link = self.links[(host, port)] = (sock, group, threading.Lock(), store)
            return link

    @staticmethod
    def _ask(sock, msg: dict) -> dict:
        sock.send(msgspec.msgpack.encode(msg))
        answer = msgspec.msgpack.decode(sock.recv())
        if "error" in answer:
            raise RuntimeError(f"the kv_producer refused: {answer['error']}")
        return answer

    def _load(self, request_id: str, params: dict, first: int, local_blocks: list[int]) -> None:
        if self.kv_cache.data.is_cuda:
            torch.cuda.set_device(self.kv_cache.data.device)  # this thread's device
        start = time.perf_counter()
        try:
            sock, group, lock, _ = self._link(params["remote_host"], params["remote_port"])
            with lock:
                remote_id = params["remote_request_id"]
                received = 0
                if local_blocks:  # none: this engine's prefix cache holds the whole prompt, the lease is only freed
                    self._ask(sock, {"kind": "pull", "request_id": remote_id, "first": first,
                                     "blocks": params["remote_block_ids"][first:first + len(local_blocks)]})
                index = torch.tensor(local_blocks, dtype=torch.int64)
                for t in cache_tensors(self.kv_cache) if local_blocks else ():
                    for layer in range(t.shape[1]):
                        view = t[:, layer]
                        rows = torch.empty((view.shape[0], len(local_blocks), *view.shape[2:]), dtype=t.dtype,
                                           device=t.device)
                        group.recv([rows], 0, 0).wait()
                        view.index_copy_(1, index.to(t.device), rows)
                        received += rows.numel() * rows.element_size()
                self._ask(sock, {"kind": "ack", "request_id": remote_id})
            self.stats["kv_received_bytes"] += received
            self.stats["kv_received_blocks"] += len(local_blocks)
            self.stats["kv_load_s"] += time.perf_counter() - start  # the handshake (once a producer), pull and ack
            self.events.put(("loaded", request_id, received))
        except Exception as e:  # noqa: BLE001 (the policy decides: recompute or fail)
            self.stats["kv_load_failures"] += 1
            with self.links_lock:  # a link that failed is made again for the next request
                link = self.links.pop((params.get("remote_host"), params.get("remote_port")), None)
            if link is not None:
                link[0].close(linger=0)
            self.events.put(("failed", request_id, f"{type(e).__name__}: {e}"))

    def close(self) -> None:
        for t in self.threads:
            t.join(timeout=self.config.kv_timeout_s)
        for sock, *_ in self.links.values():
            sock.close(linger=0)
        self.ctx.term()
