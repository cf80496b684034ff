"""mkdocs hook: write each chapter's code listing from the steps/ folders at build time.

In a chapter's markdown:
    <!-- step-diff: step01 step02 -->   the unified diff of every file that changed from step01 to step02
    <!-- step-files: step01 -->         every Python file of step01, in full
Nothing is pasted by hand, so a chapter can never show code the repo does not have.
"""
from __future__ import annotations

import difflib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STEPS = ROOT / "steps"
DIFF_MARK = re.compile(r"<!--\s*step-diff:\s*(\S+)\s+(\S+)\s*-->")
FILES_MARK = re.compile(r"<!--\s*step-files:\s*(\S+)\s*-->")


def _files(step: str) -> dict[str, str]:
    folder = STEPS / step
    if not folder.is_dir():
        raise ValueError(f"step-diff/step-files: no folder steps/{step}")
    return {p.name: p.read_text() for p in sorted(folder.glob("*.py")) if p.name != "__init__.py"}


def _fence(lang: str, text: str) -> str:
    return f"```{lang}\n{text.rstrip()}\n```"


def render_diff(old: str, new: str) -> str:
    a, b = _files(old), _files(new)
    parts, unchanged = [], []
    for name in sorted(set(a) | set(b), key=lambda n: (n not in ("model.py", "engine.py"), n)):
        if name not in a:
            parts.append(f"#### `{name}` (new file)\n\n" + _fence("python", b[name]))
        elif name not in b:
            parts.append(f"#### `{name}` (removed)")
        elif a[name] == b[name]:
            unchanged.append(f"`{name}`")
        else:
            diff = difflib.unified_diff(a[name].splitlines(), b[name].splitlines(),
                                        f"steps/{old}/{name}", f"steps/{new}/{name}", n=3, lineterm="")
            parts.append(f"#### `{name}`\n\n" + _fence("diff", "\n".join(diff)))
    if unchanged:
        parts.append("Unchanged: " + ", ".join(unchanged) + ".")
    return "\n\n".join(parts)


def render_files(step: str) -> str:
    return "\n\n".join(f"#### `steps/{step}/{name}`\n\n" + _fence("python", text) for name, text in _files(step).items())


def on_page_markdown(markdown: str, **kwargs) -> str:
    markdown = DIFF_MARK.sub(lambda m: render_diff(m.group(1), m.group(2)), markdown)
    return FILES_MARK.sub(lambda m: render_files(m.group(1)), markdown)
