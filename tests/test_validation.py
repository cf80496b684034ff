"""Bad input gets a ValueError that names the field and the limit, in every step."""
import pytest

from conftest import STEPS, cached_llm
from shared import SamplingParams, resolve_model
from helpers import load_engine

TINY = "random:tiny-llama"  # context: 2048 tokens


@pytest.mark.parametrize("kwargs,field", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=-3), "max_tokens"),
    (dict(temperature=-0.1), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(min_p=1.5), "min_p"),
    (dict(logprobs=-1), "logprobs"),
    (dict(stop=[""]), "stop"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=float("inf")), "temperature"),
    (dict(temperature=1e-30), "temperature"),
    (dict(temperature="hot"), "temperature"),
    (dict(top_p=None), "top_p"),
    (dict(top_p=float("nan")), "top_p"),
    (dict(min_p=float("nan")), "min_p"),
    (dict(top_k=2.5), "top_k"),
    (dict(top_k=True), "top_k"),
    (dict(max_tokens=4.0), "max_tokens"),
    (dict(seed=1.5), "seed"),
    (dict(logprobs=True), "logprobs"),
    (dict(ignore_eos="no"), "ignore_eos"),
    (dict(stop=5), "stop"),
    (dict(stop_token_ids=["2"]), "stop_token_ids"),
])
def test_bad_sampling_params(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("step", STEPS)
def test_bad_prompts(step):
    llm = cached_llm(step, TINY)
    sp = SamplingParams(temperature=0, max_tokens=4)
    with pytest.raises(ValueError, match="empty prompt"):
        llm.generate([""], sp)
    with pytest.raises(ValueError, match="empty prompt"):
        llm.generate([[]], sp)
    with pytest.raises(ValueError, match="prompts"):
        llm.generate([], sp)
    with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 49152\)"):
        llm.generate([[1, 2, 49152]], sp)
    with pytest.raises(ValueError, match="token id True: expected an int, got bool"):
        llm.generate([[1, True]], sp)
    with pytest.raises(ValueError, match=r"prompt \(2000 tokens\) \+ max_tokens \(100\) = 2100 exceeds the model's context of 2048"):
        llm.generate([[7] * 2000], SamplingParams(temperature=0, max_tokens=100))
    with pytest.raises(ValueError, match="sampling_params: got 2 for 1 prompts"):
        llm.generate([[1, 2]], [sp, sp])
    with pytest.raises(ValueError, match="role"):
        llm.chat([{"content": "hi"}], sp)
    # The limit itself is fine: prompt + max_tokens == context.
    out = llm.generate([[7] * 2044], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.mark.parametrize("step", STEPS)
def test_params_changed_after_construction_are_checked_at_submission(step):
    llm = cached_llm(step, TINY)
    sp = SamplingParams(temperature=0, max_tokens=4)
    sp.temperature = float("nan")
    with pytest.raises(ValueError, match="temperature must be a finite number"):
        llm.generate([[1, 2]], sp)
    sp = SamplingParams(temperature=0, max_tokens=4)
    sp.max_tokens = 0
    with pytest.raises(ValueError, match="max_tokens"):
        llm.generate([[1, 2]], sp)
    if hasattr(llm, "add_request"):
        with pytest.raises(ValueError, match="max_tokens"):
            llm.add_request([1, 2], sp)
        for bare in (12, True, None):  # one number is not a prompt (nor read as token id 12)
            with pytest.raises(ValueError, match="prompt: expected a string or a list of token ids, got"):
                llm.add_request(bare, SamplingParams(temperature=0, max_tokens=4))
        assert not llm.has_unfinished_requests(), "a refused request was queued"
    with pytest.raises(ValueError, match=r"conversations\[0\]: a message's content must be a string, got list"):
        llm.chat([{"role": "user", "content": ["What", "is", "this?"]}], SamplingParams(temperature=0))
    with pytest.raises(ValueError, match="content must be a string, got NoneType"):
        llm.chat([{"role": "user", "content": None}], SamplingParams(temperature=0))


def test_params_are_copied_at_submission():
    from shared import normalize_sampling_params
    sp = SamplingParams(temperature=0, max_tokens=4, stop="x")
    copies = normalize_sampling_params(sp, 2, SamplingParams())
    sp.max_tokens = 99  # changing the caller's object later changes no queued request
    assert [c.max_tokens for c in copies] == [4, 4] and copies[0].stop == ["x"]
    sp.stop = "y"  # a plain string set after construction is normalised like the constructor does
    assert normalize_sampling_params(sp, 1, SamplingParams())[0].stop == ["y"]


@pytest.mark.parametrize("step", STEPS)
def test_bad_model_device_dtype(step):
    LLM = load_engine(step).LLM
    with pytest.raises(ValueError, match="model: unknown model 'no-such-model'"):
        LLM("no-such-model")
    with pytest.raises(ValueError, match="model: unknown random shape"):
        LLM("random:no-such-shape")
    with pytest.raises(ValueError, match="dtype: unknown 'float8'"):
        LLM(TINY, device="cpu", dtype="float8")
    with pytest.raises(ValueError, match="device"):
        LLM(TINY, device="tpu")


def test_step01_refuses_what_it_cannot_do():
    llm = cached_llm("step01", TINY)
    with pytest.raises(ValueError, match="temperature: step01 decodes greedily only"):
        llm.generate([[1, 2]], SamplingParams(temperature=0.7))
    with pytest.raises(ValueError, match="stop"):
        llm.generate([[1, 2]], SamplingParams(temperature=0, stop=["x"]))


def test_local_folder_is_a_model_name(tmp_path):
    folder = resolve_model(TINY)
    assert resolve_model(str(folder)) == folder
    with pytest.raises(ValueError, match="needs config.json"):
        resolve_model(str(tmp_path))
