"""The model zoo: the embedded model converts, random models are seeded and have random norms."""
import json

import torch

from shared.models import RANDOM_SHAPES, _hf_config_dict, make_random_weights, random_weight_names, resolve_model


def test_random_weights_are_deterministic_and_norms_are_not_ones():
    cfg = _hf_config_dict(RANDOM_SHAPES["tiny-llama"])
    a, b = make_random_weights(cfg), make_random_weights(cfg)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    c = make_random_weights(cfg, seed=99)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])
    norms = [k for k in a if k.endswith("norm.weight")]
    assert len(norms) == 2 * cfg["num_hidden_layers"] + 1
    for k in norms:
        assert not torch.allclose(a[k], torch.ones_like(a[k]))
    assert "lm_head.weight" in a  # tiny-llama has untied embeddings


def test_random_qwen3_has_qk_norms():
    names = {n for n, _ in random_weight_names(_hf_config_dict(RANDOM_SHAPES["qwen3-0.6b"]))}
    assert "model.layers.0.self_attn.q_norm.weight" in names and "lm_head.weight" not in names


def test_embedded_model_is_the_real_smollm2():
    folder = resolve_model("smollm2-135m")
    config = json.loads((folder / "config.json").read_text())
    assert (config["model_type"], config["num_hidden_layers"], config["hidden_size"]) == ("llama", 30, 576)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["tie_word_embeddings"]) == (9, 3, True)
    assert "quantization_config" not in config  # saved as plain fp32 safetensors
    assert (folder / "tokenizer.json").is_file()


def test_a_tokenizer_is_loaded_once_per_folder_and_again_when_its_files_change(tmp_path):
    import os
    import shutil

    from shared import Tokenizer

    folder = tmp_path / "model"
    shutil.copytree(resolve_model("random:tiny-llama"), folder)
    a, b = Tokenizer(folder), Tokenizer(folder)
    assert a.hf is b.hf and a.encode("The quick brown fox") == b.encode("The quick brown fox")
    config = folder / "tokenizer_config.json"
    os.utime(config, ns=(config.stat().st_atime_ns, config.stat().st_mtime_ns + 10**9))  # the file changed
    assert Tokenizer(folder).hf is not a.hf


def test_two_processes_build_the_same_model_into_an_empty_cache_at_once(tmp_path):
    """The test workers of a fresh clone ask for the same models at the same moment: one builds, the other waits
    for it (a lock beside the folder) and loads the result, instead of both writing one temporary folder."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "LLM_STEPS_CACHE": str(tmp_path / "cache")}
    code = "from shared import resolve_model; print(resolve_model('random:tiny-llama'))"
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    results = [p.communicate(timeout=300) + (p.returncode,) for p in procs]
    assert all(rc == 0 for _, _, rc in results), [err[-2000:] for _, err, _ in results]
    built = [err.count("building random:tiny-llama") for _, err, _ in results]
    assert sorted(built) == [0, 1], f"exactly one process builds the model: {built}"
    assert (tmp_path / "cache" / "models" / "random-tiny-llama-seed1234" / "model.safetensors").is_file()
