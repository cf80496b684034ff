"""mkdocs hook: write each chapter's code from the steps/ folders at build time, and link the chapters.

In a chapter's markdown:
    <!-- step-diff: step01 step02 -->   the unified diff of every file (kernels/ included) that changed from step01 to step02:
                                        the lesson's files first (new files, then the most changed),
                                        run.py (the demo) last and collapsed
    <!-- step-files: step01 -->         every Python file of step01, in full
    <!-- step-sources: step05 -->       every Python file of step05, in full, each collapsed (the chapter's
                                        "Source files" section, which the line under the title links to)
Every page under steps/ also gets a line under its title: the previous and the next chapter, and the
step's source files. Nothing is pasted by hand, so a chapter can never show code the repo does not have.
"""
from __future__ import annotations

import difflib
import re
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STEPS = ROOT / "steps"
DIFF_MARK = re.compile(r"<!--\s*step-diff:\s*(\S+)\s+(\S+)\s*-->")
FILES_MARK = re.compile(r"<!--\s*step-files:\s*(\S+)\s*-->")
SOURCES_MARK = re.compile(r"<!--\s*step-sources:\s*(\S+)\s*-->")
DEMO = "run.py"


def _files(step: str) -> dict[str, str]:
    folder = STEPS / step
    if not folder.is_dir():
        raise ValueError(f"step-diff/step-files: no folder steps/{step}")
    # The step's own files and its kernels/ (Part 6 on), named by their path inside the step folder.
    files = sorted([*folder.glob("*.py"), *folder.glob("kernels/*.py")])
    return {p.relative_to(folder).as_posix(): p.read_text() for p in files if p.name != "__init__.py"}


def _fence(lang: str, text: str) -> str:
    return f"```{lang}\n{text.rstrip()}\n```"


def _collapsed(title: str, body: str) -> str:
    return f'??? note "{title}"\n\n' + textwrap.indent(body, "    ") + "\n"


def _anchor(step: str, name: str) -> str:
    return f"src-{step}-{name.replace('.', '-').replace('/', '-')}"


def render_diff(old: str, new: str) -> str:
    a, b = _files(old), _files(new)
    new_files = [n for n in b if n not in a and n != DEMO]
    changed = {}
    for name in sorted(set(a) & set(b)):
        if a[name] != b[name]:
            changed[name] = list(difflib.unified_diff(a[name].splitlines(), b[name].splitlines(),
                                                      f"steps/{old}/{name}", f"steps/{new}/{name}", n=3, lineterm=""))
    # The lesson first: new files, then the changed files with the most changed lines; the demo last.
    size = {n: sum(1 for line in d if line[:1] in "+-" and line[:3] not in ("+++", "---")) for n, d in changed.items()}
    order = new_files + sorted((n for n in changed if n != DEMO), key=lambda n: -size[n])
    parts = []
    for name in order:
        if name in new_files:
            parts.append(f"#### `{name}` (new file)\n\n" + _fence("python", b[name]))
        else:
            parts.append(f"#### `{name}`\n\n" + _fence("diff", "\n".join(changed[name])))
    for name in sorted(set(a) - set(b)):
        parts.append(f"#### `{name}` (removed)")
    if DEMO in changed:
        parts.append(_collapsed(f"run.py, the demo: {size[DEMO]} changed lines (click to open)",
                                _fence("diff", "\n".join(changed[DEMO]))))
    elif DEMO in b and DEMO not in a:
        parts.append(_collapsed("run.py, the demo (new file)", _fence("python", b[DEMO])))
    unchanged = [f"`{n}`" for n in sorted(set(a) & set(b)) if n not in changed]
    if unchanged:
        parts.append("Unchanged: " + ", ".join(unchanged) + ".")
    return "\n\n".join(parts)


def render_files(step: str) -> str:
    """Every file in full, model and engine first, the demo last and folded."""
    files = _files(step)
    order = sorted((n for n in files if n != DEMO), key=lambda n: (n not in ("model.py", "engine.py"), n))
    parts = [f"#### `steps/{step}/{name}`\n\n" + _fence("python", files[name]) for name in order]
    if DEMO in files:
        parts.append(_collapsed(f"steps/{step}/run.py, the demo (click to open)", _fence("python", files[DEMO])))
    return "\n\n".join(parts)


def render_sources(step: str) -> str:
    parts = []
    for name, text in _files(step).items():
        lines = text.count("\n")
        parts.append(f'<a id="{_anchor(step, name)}"></a>\n\n'
                     + _collapsed(f"steps/{step}/{name} ({lines} lines)", _fence("python", text)))
    return "\n\n".join(parts)


def _chapter_links(page, markdown: str) -> str:
    """The line under a chapter's title: previous and next chapter, and the step's files."""
    step = Path(page.file.src_uri).stem
    links = []
    prev, nxt = page.previous_page, page.next_page
    if prev is not None and prev.file and prev.file.src_uri.startswith("steps/"):
        links.append(f"[&larr; {prev.title}]({Path(prev.file.src_uri).name})")
    if nxt is not None and nxt.file and nxt.file.src_uri.startswith("steps/"):
        links.append(f"[{nxt.title} &rarr;]({Path(nxt.file.src_uri).name})")
    if (STEPS / step).is_dir():
        has_sources = SOURCES_MARK.search(markdown) is not None
        files = [n for n in _files(step)]
        if has_sources:
            links.append(f"code: `steps/{step}/` " + " ".join(f"[`{n}`](#{_anchor(step, n)})" for n in files))
        else:
            links.append(f"code: `steps/{step}/` (" + ", ".join(f"`{n}`" for n in files) + ")")
    if re.search(r"^## Further reading", markdown, re.M):
        links.append("[papers](#further-reading)")
    if not links:
        return markdown
    line = " &middot; ".join(links) + "\n{ .chapter-links }\n"
    # under the title (the first line)
    title, _, rest = markdown.partition("\n")
    return f"{title}\n\n{line}\n{rest}"


def on_page_markdown(markdown: str, page, **kwargs) -> str:
    if page.file.src_uri.startswith("steps/"):
        markdown = _chapter_links(page, markdown)
    markdown = DIFF_MARK.sub(lambda m: render_diff(m.group(1), m.group(2)), markdown)
    markdown = SOURCES_MARK.sub(lambda m: render_sources(m.group(1)), markdown)
    return FILES_MARK.sub(lambda m: render_files(m.group(1)), markdown)
