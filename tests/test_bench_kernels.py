"""docs/data/bench_kernels.py runs end to end (--smoke: tiny sizes, Triton's interpreter on the CPU) and writes every
section it has a module for; docs/hooks/figures.py draws the three kernel rooflines from h200.json's "kernels" entry
and fails clearly without it."""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import ROOT
from registry import introducing

pytest.importorskip("triton")
pytest.importorskip("matplotlib")

SCRIPT = ROOT / "docs" / "data" / "bench_kernels.py"
# The decode kernels: the steps' files once they exist, else the drafts (LLM_KERNEL_DRAFTS, while Part 6 is written).
DRAFTS = Path(os.environ.get("LLM_KERNEL_DRAFTS", "/work/kernels_scratch"))
DECODE = [ROOT / "steps" / introducing("triton_decode") / "kernels" / "decode.py", DRAFTS / "decode.py"]
FLASH = [ROOT / "steps" / introducing("flash_decoding") / "kernels" / "decode.py", DRAFTS / "flash_decoding.py"]
ROOFLINES = ("roofline-prefill", "roofline-decode", "roofline-flash-decoding")
# The smoke run (the module fixture `smoke`) runs once per process: the file's tests run on one pytest-xdist worker
# (--dist loadgroup), not spread over two that would each run it.
pytestmark = pytest.mark.xdist_group("bench_kernels_smoke")


def _first(paths):
    return next((p for p in paths if p.is_file()), paths[0])  # the steps' path (missing) when none exists


def run_script(out: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--out", str(out), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=180)


def _numbers(row: dict):
    return {k: v for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "kernels.json"
    decode, flash = _first(DECODE), _first(FLASH)
    proc = run_script(out, "--decode-module", str(decode), "--flash-module", str(flash))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text()), proc.stdout, decode, flash


def test_smoke_run_writes_every_section_it_has_a_module_for(smoke):
    data, stdout, decode, flash = smoke
    assert data["smoke"] is True and data["device"] and data["torch"] and data["triton"] and data["date"]
    assert data["copy"]["gb_per_s"] > 0 and data["copy"]["bytes"] == 2 * data["copy"]["size_bytes"]
    present = {"prefill": True, "decode": decode.is_file(), "flash_decoding": flash.is_file(),
               "splits": flash.is_file()}
    for section, expected in present.items():
        if not expected:  # skipped, and said so: the file it looked for is named
            assert data[section] is None, section
            assert str(decode if section == "decode" else flash) in stdout
            continue
        assert data[section], f"{section}: no rows"
        for row in data[section]:
            for key, value in _numbers(row).items():
                assert value > 0 or key == "max_abs_diff", f"{section} {key} = {value}"
    assert {r["block_size"] for r in data["prefill"]} == {16, 64}
    assert "prefill" in stdout and "kernel/SDPA" in stdout  # the printed tables
    if data["splits"]:
        assert sum(r["chosen"] for r in data["splits"]) == 1


def test_missing_modules_are_skipped_by_name(tmp_path):
    out = tmp_path / "k.json"
    missing = [str(tmp_path / f"no_{n}.py") for n in ("prefill", "decode", "flash")]
    proc = run_script(out, "--prefill-module", missing[0], "--decode-module", missing[1], "--flash-module", missing[2])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    for path in missing:
        assert path in proc.stdout and any(path in why for why in data["skipped"].values())
    assert data["copy"]["gb_per_s"] > 0
    assert data["prefill"] is None and data["decode"] is None and data["flash_decoding"] is None


def test_a_wrong_kernel_fails_loudly(tmp_path):
    wrong = tmp_path / "wrong.py"
    wrong.write_text("import torch\n\ndef paged_attention(q, *args, **kwargs):\n    return torch.zeros_like(q)\n")
    out = tmp_path / "k.json"
    proc = run_script(out, "--prefill-module", str(wrong), "--decode-module", str(tmp_path / "none.py"),
                      "--flash-module", str(tmp_path / "none.py"))
    assert proc.returncode == 1 and "FAILED" in proc.stderr
    assert "kernel vs SDPA" in json.loads(out.read_text())["failed"]


# ---------------------------------------------------------------- the figures hook

def synthetic_kernels() -> dict:
    copy = 4000.0
    return {
        "device": "NVIDIA H200", "dtype": "bfloat16", "date": "2026-01-01", "smoke": False,
        "shapes": {"heads": 16, "kv_heads": 8, "head_dim": 128}, "skipped": {},
        "sdpa_kernels": ["cudnn_generated_fort_native_sdpa_sm90_flash_fprop"],
        "copy": {"gb_per_s": copy, "tb_per_s": copy / 1000},
        "prefill": [dict(seq_len=s, block_size=b, sdpa_tflops=100.0 + s / 20, kernel_tflops=50.0 + s / 40)
                    for s, b in ((512, 16), (1024, 16), (4096, 16), (4096, 64), (8192, 16))],
        "decode": [dict(batch=64, context=c, v1_gb_per_s=600.0, v2_gb_per_s=min(copy, c * 1.0)) for c in (256, 2048, 8192)],
        "flash_decoding": [dict(batch=1, context=c, num_splits=c // 1024, v2_gb_per_s=140.0, flash_gb_per_s=c / 40)
                           for c in (1024, 4096, 32768)],
    }


def load_hook(monkeypatch, data_dir: Path, kernels: dict | None):
    h200 = {"device": "h200", "description": "test", "model": "m", "date": "2026-01-01", "git_commit": "x",
            "workloads": {}}
    if kernels is not None:
        h200["kernels"] = kernels
    (data_dir / "h200.json").write_text(json.dumps(h200))
    monkeypatch.setenv("LLM_DOCS_DATA", str(data_dir))
    spec = importlib.util.spec_from_file_location("figures_hook_under_test", ROOT / "docs" / "hooks" / "figures.py")
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    hook.on_config({})
    return hook


# The chapter where the decode kernels are introduced (any chapter page would do: the hook reads its folder depth).
PAGE = SimpleNamespace(file=SimpleNamespace(src_uri=f"steps/{introducing('triton_decode')}.md",
                                            name=introducing("triton_decode")))


def test_hook_draws_the_three_rooflines(tmp_path, monkeypatch):
    hook = load_hook(monkeypatch, tmp_path, synthetic_kernels())
    page = "\n".join(f"<!-- figure: {name} -->" for name in ROOFLINES)
    html = hook.on_page_markdown(page, page=PAGE)
    for name in ROOFLINES:
        assert f'src="../../figures/{name}.svg"' in html
    hook.on_post_build({"site_dir": str(tmp_path / "site")})
    for name in ROOFLINES:
        svg = (tmp_path / "site" / "figures" / f"{name}.svg").read_text()
        assert svg.lstrip().startswith("<?xml") and "<svg" in svg


@pytest.mark.parametrize("kernels,message", [
    (None, 'no "kernels" entry'),
    ({**synthetic_kernels(), "smoke": True}, "--smoke run"),
    ({**synthetic_kernels(), "decode": None, "skipped": {"decode": "decode: skipped, the module file x.py does not exist"}},
     "no 'decode' rows (decode: skipped"),
])
def test_hook_fails_clearly_without_kernel_data(tmp_path, monkeypatch, kernels, message):
    hook = load_hook(monkeypatch, tmp_path, kernels)
    with pytest.raises(ValueError, match="roofline-") as error:
        for name in ROOFLINES:
            hook.on_page_markdown(f"<!-- figure: {name} -->", page=PAGE)
    assert message in str(error.value)


def test_hook_draws_what_the_script_writes(smoke, tmp_path, monkeypatch):
    """The script's JSON has the fields the plots read (a smoke run's, marked as a measurement for this test)."""
    data = {**smoke[0], "smoke": False}
    hook = load_hook(monkeypatch, tmp_path, data)
    for name in ROOFLINES:
        if all(data.get(section) for section in hook.ROOFLINE_NEEDS[name]):
            assert "<svg" in hook.PLOTS[name][0]()
