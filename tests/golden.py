"""Write tests/golden/step01.json: step01's greedy answers (tokens and top-5 logprobs, CPU, fp32) to the harness
prompts, on the real model and the tiny random ones step01 runs.

    python tests/golden.py

Every step is compared with this file (tests/test_equivalence.py), and step01 itself with HF transformers and with
this file: when step01 or a harness prompt changes on purpose, run this script and commit the file with the change.
"""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/ (conftest, helpers, registry)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root (shared, steps)

GOLDEN_MODELS = ["smollm2-135m", "random:tiny-llama"]


def dumps(data: dict) -> str:
    """JSON with one line per prompt and per completion, so that a regenerated file diffs line by line."""
    models = data["models"]
    head = json.dumps({k: v for k, v in data.items() if k != "models"}, indent=1)[:-2]
    lines = [head + ',\n "models": {']
    for m, (model, entry) in enumerate(models.items()):
        lines.append(f'  {json.dumps(model)}: {{\n   "prompts": [')
        lines.append(",\n".join(f"    {json.dumps(p)}" for p in entry["prompts"]) + "\n   ],")
        lines.append('   "outputs": [')
        lines.append(",\n".join(f"    {json.dumps(o)}" for o in entry["outputs"]) + "\n   ]")
        lines.append("  }" + ("," if m + 1 < len(models) else ""))
    lines.append(" }\n}\n")
    return "\n".join(lines)


def main() -> None:
    import torch

    from conftest import equivalence_prompts, greedy_outputs
    from helpers import GOLDEN, completion_record
    from registry import EQUIV_MAX_TOKENS, STEPS

    torch.manual_seed(0)
    models = {}
    for model in GOLDEN_MODELS:
        outs = greedy_outputs(STEPS[0], model)
        models[model] = {"prompts": [list(o.prompt_token_ids) for o in outs],
                         "outputs": [completion_record(o.outputs[0]) for o in outs]}
        print(f"{model}: {len(outs)} prompts, {sum(len(o.outputs[0].token_ids) for o in outs)} tokens")
    data = {"step": STEPS[0], "max_tokens": EQUIV_MAX_TOKENS, "logprobs": 5, "device": "cpu", "dtype": "float32",
            "torch": torch.__version__, "command": "python tests/golden.py", "models": models}
    GOLDEN.parent.mkdir(exist_ok=True)
    GOLDEN.write_text(dumps(data))
    print(f"written: {GOLDEN}")


if __name__ == "__main__":
    main()
