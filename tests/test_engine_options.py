"""Every step's engine options are checked by one helper (shared.check_engine_options), before the model loads:
a bad option fails at once with its own message, even when the model named could not be loaded at all."""
import importlib
import inspect

import pytest

from conftest import ROOT, STEPS
from shared import check_engine_options
from shared.bench import step_option_names

# option -> (a bad value, what the message says)
BAD = {
    "max_num_seqs": (0, "max_num_seqs must be an integer >= 1, got 0"),
    "max_num_batched_tokens": (True, "max_num_batched_tokens must be an integer >= 1, got True"),
    "gpu_memory_utilization": (1.5, r"gpu_memory_utilization must be a number in \(0, 1\], got 1.5"),
    "max_kv_tokens": (-5, "max_kv_tokens must be (None or )?an integer >= 1, got -5"),
    "block_size": (0, r"block_size must be an integer in \[1, max_kv_tokens=\d+\], got 0"),
    "enable_prefix_caching": ("yes", "enable_prefix_caching must be True or False, got 'yes'"),
    "kv_cache_dtype": ("fp4", "kv_cache_dtype must be one of 'auto', 'int8'(, 'fp8', 'fp8_e4m3')?, got 'fp4'"),  # step20 on
    "enforce_eager": (1, "enforce_eager must be True or False, got 1"),  # cuda_graphs (step21 on)
    "tensor_parallel_size": (0, "tensor_parallel_size must be a positive int, got 0"),  # tensor_parallel (step22 on)
    "async_scheduling": ("yes", "async_scheduling must be True, False or None, got 'yes'"),  # step25 on
    "max_logprobs": (0, "max_logprobs must be an integer >= 1, got 0"),  # step23 on
    "quantization": ("int3", r"quantization must be None \(the checkpoint's weights as shipped\) or one of"),  # step29 on
    "enable_expert_parallel": ("yes", "enable_expert_parallel must be True or False, got 'yes'"),  # step31 on
    "kv_offloading_size": [  # step32 on: a number, finite, and no more than the host can give
        (-1, "kv_offloading_size must be a size in GiB >= 0"),
        (float("nan"), "kv_offloading_size must be a size in GiB >= 0 .*got nan"),
        (float("inf"), "kv_offloading_size must be a size in GiB >= 0 .*got inf"),
        (1e12, r"kv_offloading_size=1000000000000.0 GiB is more than this host's available memory \([0-9.]+ GiB\)"),
    ],
}


def bad_values(name: str) -> list[tuple]:
    """BAD's (value, message) pairs for option `name`: one, or a list of them."""
    return BAD[name] if isinstance(BAD[name], list) else [BAD[name]]


def engine_options(step: str) -> list[str]:
    """The options of BAD that this step's LLM takes (its signature's, or its engine_args.py's where it takes
    **options)."""
    return [name for name in step_option_names(step) if name in BAD]


@pytest.mark.parametrize("step", [s for s in STEPS if engine_options(s)])
def test_a_bad_option_fails_before_the_model_loads(step):
    LLM = importlib.import_module(f"steps.{step}.engine").LLM
    for name in engine_options(step):
        for value, message in bad_values(name):
            # An unknown model: had the engine resolved or loaded it first, the error would be about the model.
            with pytest.raises(ValueError, match=message):
                LLM("no-such-model", device="cpu", **{name: value})


def test_the_helper_checks_only_what_it_is_given():
    check_engine_options()
    check_engine_options(max_num_seqs=1, max_num_batched_tokens=512, gpu_memory_utilization=1, max_kv_tokens=64,
                         block_size=64, enable_prefix_caching=False)
    check_engine_options(max_kv_tokens=None, block_size=2**20, may_be_none=("max_kv_tokens",))
    with pytest.raises(ValueError, match="max_kv_tokens must be an integer >= 1, got None"):
        check_engine_options(max_kv_tokens=None)  # None only where the step says the pool is sized later
    with pytest.raises(ValueError, match=r"block_size must be an integer in \[1, max_kv_tokens=32\], got 64"):
        check_engine_options(max_kv_tokens=32, block_size=64)
    with pytest.raises(ValueError, match=r"block_size must be an integer in \[1, max_kv_tokens=None\], got 2097152"):
        check_engine_options(max_kv_tokens=None, block_size=2**21, may_be_none=("max_kv_tokens",))
    for bad in (0, float("nan"), "0.9", True):
        with pytest.raises(ValueError, match="gpu_memory_utilization must be a number in"):
            check_engine_options(gpu_memory_utilization=bad)


ARGS_STEPS = [s for s in STEPS if (ROOT / "steps" / s / "engine_args.py").exists()]


@pytest.mark.parametrize("step", ARGS_STEPS)
def test_each_option_is_written_once_and_the_flags_are_made_from_it(step):
    """engine_args.py's EngineArgs is where an option is written: LLM takes model and **options (no option in its
    signature), EngineConfig adds none of its own (only what it derives, not given), serve.py's parser has one flag
    per option in its config's group, and an unknown option is refused by name."""
    import dataclasses

    args, config = (importlib.import_module(f"steps.{step}.{name}") for name in ("engine_args", "config"))
    names = [f.name for f in args.option_fields()]
    LLM = importlib.import_module(f"steps.{step}.engine").LLM
    assert [p.kind.name for p in inspect.signature(LLM).parameters.values()] == ["POSITIONAL_OR_KEYWORD", "VAR_KEYWORD"]
    own = [f.name for f in dataclasses.fields(config.EngineConfig) if f.init and f.name not in names]
    assert not own, f"EngineConfig declares options of its own: {own}"
    parser = importlib.import_module(f"steps.{step}.serve").engine_arg_parser("x")
    groups = {g.title: [a.dest for a in g._group_actions] for g in parser._action_groups if g.title in args.GROUPS}
    by_group = {group: [f.name for f in args.option_fields() if f.metadata["group"] == group] for group in args.GROUPS}
    assert groups == by_group
    parsed = parser.parse_args(["--no-enable-prefix-caching", "--max-num-seqs", "3", "--async-scheduling"])
    options = importlib.import_module(f"steps.{step}.serve").engine_options(parsed)
    assert set(options) == set(names) - {"model"}
    assert options["enable_prefix_caching"] is False and options["max_num_seqs"] == 3 and options["async_scheduling"]
    with pytest.raises(ValueError, match=r"unknown engine option 'max_num_seq'; the options are model, "):
        LLM("no-such-model", max_num_seq=3)
