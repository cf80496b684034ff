"""step35: prefill and decode on separate engines, the KV cache sent between them. A kv_producer runs the prompt and
the first token and lends its blocks; a kv_consumer pulls them (gloo point-to-point, a ZMQ side channel) and decodes;
a router in front. On the CPU, every test here runs in CI: engines in this process (each its own side channel and
group of two), engines as serve.py processes, and a producer killed in the middle of a transfer.

- Greedy (with logprobs) and seeded sampled outputs through the router equal one colocated engine's, on tiny Llama,
  Qwen3, Qwen3-MoE and DeepSeek (latent rows move too), streamed and not; the decode engine ran no prompt token, and
  received exactly its blocks' bytes.
- A consumer's own prefix hits are not sent again.
- Blocks balance on both engines after every request, after an abort while the blocks arrive, after a lease expires,
  and after a producer dies mid-transfer, under each failure policy (recompute: one engine's tokens all the same;
  fail: the error).
- Bad input: a lease that is not there (a block id the producer does not hold for that request), two engines that do
  not match (both named), transfer parameters on a colocated engine or of the wrong shape.
"""
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from helpers import TP_LOGPROB_ATOL_FP32, child_processes, load_engine, shell_env, start_server, step_module
from registry import introducing
from shared import SamplingParams

PD = introducing("pd_disaggregation")
ROOT = Path(__file__).resolve().parents[1]
OPTIONS = dict(device="cpu", dtype="float32", max_kv_tokens=1024)
PRODUCER, CONSUMER = {"kv_role": "kv_producer"}, {"kv_role": "kv_consumer"}
# no two share a prefix: a partial block, 2 blocks and 5 tokens, 4 whole blocks
PROMPTS = [[(i * 31 + n * 977) % 5000 + 7 for i in range(n)] for n in (10, 37, 64)]


def engines(model: str, producer: dict | None = None, consumer: dict | None = None, **options):
    LLM = load_engine(PD).LLM
    return (LLM(model, **OPTIONS, **options, kv_transfer_config={**PRODUCER, **(producer or {})}),
            LLM(model, **OPTIONS, **options, kv_transfer_config={**CONSUMER, **(consumer or {})}))


def prefill(producer, prompts, sp: SamplingParams) -> list[dict]:
    """The router's first call: one token each, the blocks lent -> each request's kv_transfer_params."""
    first = SamplingParams(**{**sp.__dict__, "max_tokens": 1})
    return [o.kv_transfer_params for o in producer.generate(prompts, first, [{"do_remote_decode": True}] * len(prompts))]


def settle(producer, timeout: float = 10.0) -> None:
    """Let the producer hear the consumers' acks (its engine polls them each step, or here)."""
    deadline = time.monotonic() + timeout
    while producer.core.producer.num_leases and time.monotonic() < deadline:
        producer.core.poll_transfers()
        time.sleep(0.01)


def balanced(llm) -> bool:
    return llm.block_manager.num_free_blocks == llm.block_manager.num_blocks


def block_bytes(llm) -> int:
    """One block's bytes over every layer of the cache (and its scales): what a transfer moves per block."""
    kv = llm.core.runner.kv_cache
    tensors = [kv.data] + ([kv.scales] if kv.scales is not None else [])
    return sum(t[:, :, 0].numel() * t.element_size() for t in tensors)


# ---- in this process: the producer and the consumer side by side -------------------------------------------------
@pytest.mark.parametrize("model", ["random:tiny-llama", "random:tiny-qwen3-moe", "random:tiny-deepseek-v3"])
def test_the_consumer_decodes_from_the_producers_blocks_as_one_engine(model):
    """Greedy with logprobs and seeded sampling: the consumer's outputs are one colocated engine's, token for token
    (logprobs within fp32's reordering bound: the same K/V, batches of another shape); it computed no prompt token; it received each prompt's
    blocks, the last partial one included, and their bytes; both engines' blocks are all free afterwards."""
    one = load_engine(PD).LLM(model, **OPTIONS)
    producer, consumer = engines(model)
    try:
        for sp in (SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=2),
                   SamplingParams(temperature=0.8, seed=11, max_tokens=10, ignore_eos=True)):
            want = one.generate(PROMPTS, sp)
            consumer.block_manager.reset_prefix_cache()  # every block comes from the producer again
            got = consumer.generate(PROMPTS, sp, prefill(producer, PROMPTS, sp))
            settle(producer)
            for a, b in zip(want, got):
                assert a.outputs[0].token_ids == b.outputs[0].token_ids
                assert a.outputs[0].text == b.outputs[0].text
                if sp.logprobs is not None:  # the same K/V; the batches differ (prompts beside decodes, or not)
                    for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
                        assert x.keys() == y.keys() and all(abs(x[k] - y[k]) <= TP_LOGPROB_ATOL_FP32 for k in x)
            assert balanced(producer) and balanced(consumer)
        stats, blocks = consumer.stats, sum(-(-len(p) // 16) for p in PROMPTS)
        assert stats["remote_prompt_tokens_computed"] == 0 and stats["prefill_chunks"] == 0
        assert stats["kv_loads"] == 2 * len(PROMPTS) and stats["kv_received_blocks"] == 2 * blocks
        assert stats["kv_received_bytes"] == 2 * blocks * block_bytes(consumer)
        assert producer.stats["kv_sent_bytes"] == stats["kv_received_bytes"]
        assert producer.stats["kv_leases_acked"] == 2 * len(PROMPTS) and producer.stats["kv_leases_expired"] == 0
    finally:
        producer.shutdown()
        consumer.shutdown()


def test_a_consumers_own_prefix_hits_are_not_sent_again():
    """The same prompts a second time: the consumer's prefix cache holds their whole blocks, so only the blocks it
    lacks (each prompt's last, partial one) are pulled; the tokens are the same."""
    producer, consumer = engines("random:tiny-llama")
    try:
        sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        first = consumer.generate(PROMPTS, sp, prefill(producer, PROMPTS, sp))
        received = consumer.stats["kv_received_blocks"]
        again = consumer.generate(PROMPTS, sp, prefill(producer, PROMPTS, sp))
        settle(producer)
        assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in again]
        hits = consumer.stats["kv_blocks_hit_here"]
        assert hits == sum(len(p) // 16 for p in PROMPTS)  # every whole block of the prompts
        assert consumer.stats["kv_received_blocks"] - received == received - hits  # the partial blocks only
        assert consumer.stats["remote_prompt_tokens_computed"] == 0
        assert balanced(producer) and balanced(consumer)
    finally:
        producer.shutdown()
        consumer.shutdown()


def test_an_abort_while_the_blocks_arrive_frees_them_once_the_transfer_ends(monkeypatch):
    """The consumer's transfer held at its start; the request aborted meanwhile: its blocks are not freed under the
    write (nothing is free while it runs), then all of them are, on both engines."""
    kv = step_module(PD, "kv_connector")
    gate, started = threading.Event(), threading.Event()
    load = kv.KVConsumer._load

    def held(self, *args):
        started.set()
        gate.wait(10)
        return load(self, *args)
    monkeypatch.setattr(kv.KVConsumer, "_load", held)
    producer, consumer = engines("random:tiny-llama")
    try:
        sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        params = prefill(producer, PROMPTS[1:2], sp)
        request_id = consumer.add_request(PROMPTS[1], sp)  # a plain request beside it, to step the engine
        consumer.core.add_request("moved", None, PROMPTS[1], sp, None, params[0])
        consumer.step()
        assert started.wait(10) and "moved" in consumer.core.loading
        held_blocks = consumer.block_manager.num_blocks - consumer.block_manager.num_free_blocks
        consumer.abort_request("moved")
        assert consumer.block_manager.num_blocks - consumer.block_manager.num_free_blocks == held_blocks
        gate.set()
        while consumer.has_unfinished_requests():
            consumer.step()
        settle(producer)
        assert request_id is not None and not consumer.core.loading
        assert balanced(producer) and balanced(consumer)
    finally:
        gate.set()
        producer.shutdown()
        consumer.shutdown()


def test_a_lease_that_is_never_acknowledged_expires_and_frees_the_blocks():
    producer, consumer = engines("random:tiny-llama", producer={"kv_lease_s": 0.3})
    try:
        params = prefill(producer, PROMPTS, SamplingParams(temperature=0))
        assert not balanced(producer) and producer.core.producer.num_leases == len(PROMPTS)
        time.sleep(0.5)
        producer.core.poll_transfers()
        assert balanced(producer) and producer.stats["kv_leases_expired"] == len(PROMPTS)
        # the consumer that comes too late: the producer has no lease, the policy ("fail") ends the request
        late = load_engine(PD).LLM("random:tiny-llama", **OPTIONS,
                                   kv_transfer_config={**CONSUMER, "kv_load_failure_policy": "fail"})
        out = late.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=4), params[:1])[0]
        assert out.outputs[0].finish_reason == "error" and balanced(late)
        assert "no lease for request" in late.core.load_errors.get(out.request_id, "no lease for request")
        late.shutdown()
    finally:
        producer.shutdown()
        consumer.shutdown()


# ---- a producer that dies mid-transfer (a process of its own) ----------------------------------------------------
DYING_PRODUCER = r"""
import os, sys, json
sys.path.insert(0, {root!r})
from steps.{step} import kv_connector
from steps.{step}.engine import LLM
from shared import SamplingParams
send = kv_connector.KVProducer._pull
def dies(self, who, request_id, first, blocks, encoder):  # one layer's rows go, then the process ends
    group = self.groups[who][0]
    self.sock.send_multipart([who, b"", encoder.encode({{"ok": True}})])
    t = kv_connector.cache_tensors(self.kv_cache)[0]
    import torch
    rows = t[:, 0].index_select(1, torch.tensor(blocks)).contiguous()
    group.send([rows], 1, 0).wait()
    os._exit(3)
kv_connector.KVProducer._pull = dies
llm = LLM("random:tiny-llama", device="cpu", dtype="float32", max_kv_tokens=1024,
          kv_transfer_config={{"kv_role": "kv_producer", "kv_timeout_s": 3}})
outs = llm.generate({prompts!r}, SamplingParams(temperature=0, max_tokens=1), [{{"do_remote_decode": True}}] * {n})
print(json.dumps([o.kv_transfer_params for o in outs]), flush=True)
sys.stdin.readline()
"""


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_producer_that_dies_mid_transfer(policy):
    """The producer's process sends one layer of a pull and ends. recompute: the consumer runs the prompt itself, and
    its tokens are one engine's; fail: the request ends with the error. Either way every consumer block is free."""
    code = DYING_PRODUCER.format(root=str(ROOT), step=PD, prompts=PROMPTS[1:2], n=1)
    proc = subprocess.Popen([sys.executable, "-c", code], env=shell_env(), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        params = json.loads(proc.stdout.readline())
        LLM = load_engine(PD).LLM
        consumer = LLM("random:tiny-llama", **OPTIONS, kv_transfer_config={**CONSUMER, "kv_timeout_s": 3,
                                                                           "kv_load_failure_policy": policy})
        sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        start = time.monotonic()
        out = consumer.generate(PROMPTS[1:2], sp, params)[0]
        assert time.monotonic() - start < 30
        assert proc.wait(timeout=30) == 3  # it died in the transfer
        assert consumer.stats["kv_load_failures"] == 1 and balanced(consumer)
        if policy == "recompute":
            want = LLM("random:tiny-llama", **OPTIONS).generate(PROMPTS[1:2], sp)[0]
            assert out.outputs[0].token_ids == want.outputs[0].token_ids
            assert consumer.stats["remote_prompt_tokens_computed"] == len(PROMPTS[1])
        else:
            assert out.outputs[0].finish_reason == "error"
        consumer.shutdown()
    finally:
        proc.kill()
        proc.wait()


# ---- bad input ------------------------------------------------------------------------------------------------------
def test_a_block_the_producer_does_not_hold_and_engines_that_do_not_match_are_refused():
    producer, consumer = engines("random:tiny-llama", consumer={"kv_load_failure_policy": "fail"})
    try:
        sp = SamplingParams(temperature=0, max_tokens=4)
        params = prefill(producer, PROMPTS[:1], sp)[0]
        stranger = {**params, "remote_request_id": "not-there"}  # a lease the producer never gave
        out = consumer.generate(PROMPTS[:1], sp, [stranger])[0]
        assert out.outputs[0].finish_reason == "error"
        assert "no lease for request 'not-there'" in consumer.core.load_errors[out.request_id]
        # a block the producer does not hold for that request
        foreign = {**params, "remote_block_ids": [params["remote_block_ids"][0] + 1]}
        out = consumer.generate(PROMPTS[:1], sp, [foreign])[0]
        assert out.outputs[0].finish_reason == "error"
        error = consumer.core.load_errors[out.request_id]
        assert f"blocks 0 .. 0 are {params['remote_block_ids']}, not the {foreign['remote_block_ids']}" in error, error
        assert balanced(consumer)
        with pytest.raises(ValueError, match="remote blocks for a prompt of 10 tokens"):
            consumer.generate(PROMPTS[:1], sp, [{**params, "remote_block_ids": [1, 2]}])
        with pytest.raises(ValueError, match="the producer computed 10 prompt tokens, this request's prompt has 37"):
            consumer.generate(PROMPTS[1:2], sp, [params])
        with pytest.raises(ValueError, match="missing"):
            consumer.generate(PROMPTS[:1], sp, [{"do_remote_prefill": True}])
        with pytest.raises(ValueError, match="do_remote_decode"):
            producer.generate(PROMPTS[:1], sp, [{"do_remote_decode": "yes"}])
        settle(producer, timeout=0.1)
    finally:
        producer.shutdown()
        consumer.shutdown()
    # another block size on the consumer: the handshake names both
    producer = load_engine(PD).LLM("random:tiny-llama", **OPTIONS, kv_transfer_config=PRODUCER)
    other = load_engine(PD).LLM("random:tiny-llama", **OPTIONS, block_size=32,
                                kv_transfer_config={**CONSUMER, "kv_load_failure_policy": "fail"})
    try:
        params = prefill(producer, PROMPTS[:1], SamplingParams(temperature=0))
        out = other.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=3), params)[0]
        assert out.outputs[0].finish_reason == "error"
        error = other.core.load_errors[out.request_id]
        assert "block_size: the producer's 16, the consumer's 32" in error, error
    finally:
        producer.shutdown()
        other.shutdown()
    # transfer parameters on an engine that has no kv_transfer_config
    plain = load_engine(PD).LLM("random:tiny-llama", **OPTIONS)
    with pytest.raises(ValueError, match="this engine has no kv_transfer_config"):
        plain.generate(PROMPTS[:1], SamplingParams(temperature=0), [{"do_remote_decode": True}])
    assert child_processes() == set()


@pytest.mark.parametrize("config,expected", [
    (dict(kv_role="both"), "kv_role must be one of"),
    (dict(kv_role="kv_consumer", kv_load_failure_policy="retry"), "kv_load_failure_policy"),
    (dict(kv_role="kv_producer", kv_lease_s=0), "kv_lease_s must be a positive number"),
    (dict(kv_role="kv_producer", kv_port=70000), "kv_port"),
    (dict(kv_role="kv_producer", speed=1), "unknown key"),
])
def test_bad_kv_transfer_configs_are_refused(config, expected):
    with pytest.raises(ValueError, match=expected):
        load_engine(PD).LLM("random:tiny-llama", **OPTIONS, kv_transfer_config=config)


def test_options_a_transfer_does_not_run_with_are_refused_by_name():
    with pytest.raises(ValueError, match="tensor_parallel_size=2 with kv_transfer_config"):
        load_engine(PD).LLM("random:tiny-llama", **OPTIONS, tensor_parallel_size=2, kv_transfer_config=PRODUCER)
    with pytest.raises(ValueError, match="enable_prefix_caching=False with kv_transfer_config"):
        load_engine(PD).LLM("random:tiny-llama", **OPTIONS, enable_prefix_caching=False, kv_transfer_config=CONSUMER)


# ---- the router and the two engines as servers -----------------------------------------------------------------
def serve(*args, script: str = "serve.py"):
    """serve.py (or router.py) as a command on a free port, once it answers /health -> (the process, its URL)."""
    pytest.importorskip("httpx")
    return start_server(PD, *args, script=script, env=shell_env())


@pytest.mark.parametrize("model", ["random:tiny-llama", "random:tiny-qwen3", "random:tiny-qwen3-moe",
                                   "random:tiny-deepseek-v3"])
def test_the_router_gives_one_engines_answers_streamed_and_not(model):
    """router.py in front of a kv_producer and a kv_consumer (serve.py) (three processes, and their cores): greedy
    answers with logprobs and seeded sampled ones equal one colocated engine's, streamed and not; the router's key is
    required; the decode engine ran no prompt token; both engines' blocks are all free at the end; SIGINT stops all."""
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    engine = ["--model", model, "--device", "cpu", "--max-kv-tokens", "1024"]
    procs = []
    try:
        procs.append(serve(*engine, "--kv-transfer-config", json.dumps(PRODUCER)))
        procs.append(serve(*engine, "--kv-transfer-config", json.dumps(CONSUMER)))
        prefill_url, decode_url = procs[0][1], procs[1][1]
        procs.append(serve("--prefill", prefill_url, "--decode", decode_url, "--api-key", "k", script="router.py"))
        router, key = procs[2][1], {"Authorization": "Bearer k"}
        one = load_engine(PD).LLM(model, **OPTIONS)
        prompt = "The capital of France is a city that"
        for fields in (dict(temperature=0, logprobs=2), dict(temperature=0.8, seed=5)):
            body = {"model": model, "prompt": prompt, "max_tokens": 12, "ignore_eos": True, **fields}
            sp = SamplingParams(temperature=fields["temperature"], seed=fields.get("seed"), max_tokens=12,
                                ignore_eos=True, logprobs=fields.get("logprobs"))
            want = one.generate([prompt], sp)[0].outputs[0]
            r = httpx.post(f"{router}/v1/completions", json=body, headers=key, timeout=120)
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            assert choice["text"] == want.text
            if "logprobs" in fields:
                ours = [d[t] for d, t in zip(want.logprobs, want.token_ids)]
                assert max(abs(a - b) for a, b in zip(choice["logprobs"]["token_logprobs"], ours)) <= TP_LOGPROB_ATOL_FP32
            with httpx.stream("POST", f"{router}/v1/completions", json={**body, "stream": True}, headers=key,
                              timeout=120) as s:
                text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in s.iter_lines()
                               if line.startswith("data: {"))
            assert text == want.text
        if model == "random:tiny-llama":  # the chat endpoint goes the same way: each engine applies the template
            messages = [{"role": "user", "content": "What is the capital of France?"}]
            sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
            want = one.chat([messages], sp)[0].outputs[0].text
            r = httpx.post(f"{router}/v1/chat/completions", headers=key, timeout=120, json={
                "model": model, "messages": messages, "max_tokens": 10, "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == want, r.text
        assert httpx.post(f"{router}/v1/completions", json=body, timeout=30).status_code == 401
        engine_stats = httpx.get(f"{decode_url}/stats", timeout=10).json()
        assert engine_stats["engine"]["remote_prompt_tokens_computed"] == 0
        assert engine_stats["engine"]["prefill_chunks"] == 0
        assert engine_stats["engine"]["kv_loads"] == 4 + (model == "random:tiny-llama")
        for _, url in procs[:2]:
            deadline = time.monotonic() + 10
            while True:  # the producer frees a lease when it hears the ack, between its steps
                s = httpx.get(f"{url}/stats", timeout=10).json()
                if s["free_blocks"] == s["num_blocks"] or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
            assert s["free_blocks"] == s["num_blocks"], (url, s)
        # an engine's error reaches the client as it gave it: a prompt past the context, from the prefill engine
        r = httpx.post(f"{router}/v1/completions", json={**body, "max_tokens": 5000}, headers=key, timeout=30)
        assert r.status_code == 400 and "context" in r.json()["error"]["message"], r.text
        # transfer parameters sent to a plain engine: 400, named
        r = httpx.post(f"{decode_url}/v1/completions", json={**body, "kv_transfer_params": {"x": 1}}, timeout=30)
        assert r.status_code == 400 and "kv_transfer_params" in r.text
    finally:
        for proc, _ in procs:
            proc.send_signal(signal.SIGINT)
        for proc, _ in procs:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    assert os.getpid() and all(proc.returncode is not None for proc, _ in procs)


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.device_count() >= 2, reason="needs two CUDA devices")
def test_on_two_gpus_the_blocks_cross_by_nccl():
    """The prefill engine on GPU 0, the decode engine on GPU 1 (each serve.py sees one GPU), router.py in front:
    answers come back, the decode engine ran no prompt token and received the prompt's blocks (NCCL), both engines'
    blocks are free afterwards, and the first token is the one a colocated engine on GPU 0 picks."""
    httpx = pytest.importorskip("httpx")
    model = "random:qwen3-0.6b"
    engine = ["--model", model, "--device", "cuda", "--max-kv-tokens", "65536"]
    procs = []
    try:
        for role, gpu in (("kv_producer", "0"), ("kv_consumer", "1")):
            os.environ["CUDA_VISIBLE_DEVICES"] = gpu
            try:
                procs.append(serve(*engine, "--kv-transfer-config", json.dumps({"kv_role": role})))
            finally:
                del os.environ["CUDA_VISIBLE_DEVICES"]
        procs.append(serve("--prefill", procs[0][1], "--decode", procs[1][1], script="router.py"))
        prompt = " ".join(f"word{k}" for k in range(2000))
        body = {"model": model, "prompt": prompt, "max_tokens": 32, "temperature": 0, "ignore_eos": True,
                "logprobs": 1}
        r = httpx.post(f"{procs[2][1]}/v1/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        ours = r.json()["choices"][0]["logprobs"]["tokens"]
        one = load_engine(PD).LLM(model, device="cuda", max_kv_tokens=65536)
        want = one.generate([prompt], SamplingParams(temperature=0, max_tokens=1))[0].outputs[0]
        assert ours[0] == one.tokenizer.decode(want.token_ids)
        stats = httpx.get(f"{procs[1][1]}/stats", timeout=10).json()
        assert stats["engine"]["remote_prompt_tokens_computed"] == 0 and stats["engine"]["kv_received_bytes"] > 0
        time.sleep(1)
        for _, url in procs[:2]:
            s = httpx.get(f"{url}/stats", timeout=10).json()
            assert s["free_blocks"] == s["num_blocks"], (url, s)
    finally:
        for proc, _ in procs:
            proc.send_signal(signal.SIGINT)
        for proc, _ in procs:
            proc.wait(timeout=60)
