"""The docs site builds with --strict, every step has a chapter that shows its generated diff, nothing is
clipped, and every measured figure comes from docs/data/."""
import html
import json
import re
import subprocess
import sys

import pytest

from conftest import ROOT, STEPS

# Characters of a code line that the content column shows whole in a 1400 px wide window, with
# docs/stylesheets/extra.css (code at 0.6rem, the table of contents folded into the left navigation).
# Measured with headless Chromium: the first code block of a chapter is 1086 px wide inside its padding
# and a monospace character 7.2 px wide, so 150 characters fit (1070 px and 148 inside a folded block). Wider lines would be cut off behind a
# scroll bar: shorten the line (or the diagram) rather than raise this number.
COLUMN_CHARS = 150
FOLDED_CHARS = 148  # inside a folded block (run.py's diff, the full source files) the frame takes 2 columns


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("docs") / "site"
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


def _pages(site):
    return {p: p.read_text() for p in site.rglob("*.html")}


def test_mkdocs_build_strict(site):
    for i, step in enumerate(STEPS):
        page = (site / "steps" / step / "index.html").read_text()
        assert "engine.py" in page
        if i > 0:
            assert f"steps/{STEPS[i - 1]}/engine.py" in page, f"{step}'s chapter lacks the generated diff"
    # Offline: no page pulls scripts, styles or fonts from elsewhere.
    for path, text in _pages(site).items():
        assert "fonts.googleapis.com" not in text and "cdn.jsdelivr" not in text and "unpkg.com" not in text, path
        assert not re.search(r"<(script|link)[^>]+(src|href)=\"https?://", text), f"{path} loads from the network"


def _too_wide(text: str, limit: int, where: str) -> list[str]:
    found = []
    for block in re.findall(r"<pre[^>]*>(.*?)</pre>", text, re.S):
        for line in html.unescape(re.sub(r"<[^>]+>", "", block)).splitlines():
            if len(line) > limit:
                found.append(f"{where}: {len(line)} chars (at most {limit}): {line[:60]}...")
    return found


def test_no_code_line_wider_than_the_column(site):
    too_wide = []
    for path, text in _pages(site).items():
        folded = re.findall(r"<details.*?</details>", text, re.S)
        too_wide += _too_wide("".join(folded), FOLDED_CHARS, f"{path.relative_to(site)} (folded)")
        too_wide += _too_wide(re.sub(r"<details.*?</details>", "", text, flags=re.S), COLUMN_CHARS, str(path.relative_to(site)))
    assert not too_wide, f"{len(too_wide)} code lines wider than {COLUMN_CHARS} characters:\n" + "\n".join(too_wide[:20])


def test_every_marker_was_rendered_and_every_figure_exists(site):
    for path, text in _pages(site).items():
        leftover = re.findall(r"<!--\s*(bench-[a-z]+|figure|fig-[a-z]+|step-[a-z]+|suite-[a-z]+):", text)
        assert not leftover, f"{path}: unrendered markers {leftover}"
        for src in re.findall(r'<img class="figure" src="([^"]+)"', text):
            assert (path.parent / src).resolve().is_file(), f"{path}: missing figure {src}"
    svgs = list((site / "figures").glob("*.svg"))
    assert {p.stem for p in svgs} >= {"tokens-per-s", "ms-per-token", "batch-size", "timeline", "utilisation"}
    home = (site / "index.html").read_text()
    assert "figures/tokens-per-s.svg" in home


def test_chapters_link_their_neighbours_and_sources(site):
    for i, step in enumerate(STEPS):
        page = (site / "steps" / step / "index.html").read_text()
        links = re.search(r'<p class="chapter-links">(.*?)</p>', page, re.S)
        assert links, f"{step}: no chapter links under the title"
        if i > 0:
            assert f'href="../{STEPS[i - 1]}/"' in links.group(1), f"{step} does not link {STEPS[i - 1]}"
        if i + 1 < len(STEPS):
            assert f'href="../{STEPS[i + 1]}/"' in links.group(1), f"{step} does not link {STEPS[i + 1]}"
        assert f"steps/{step}/" in links.group(1)
        assert "arxiv.org" in page or "doi.org" in page or "usenix.org" in page, f"{step} cites no paper"


def test_benchmark_data_records_where_it_comes_from():
    files = sorted((ROOT / "docs" / "data").glob("*.json"))
    devices = [f for f in files if f.name not in ("figures.json", "test_suite.json")]
    assert {f.stem for f in devices} >= {"cpu", "h200"}
    for f in devices:
        data = json.loads(f.read_text())
        for key in ("device", "description", "model", "date", "git_commit", "workloads"):
            assert data.get(key), f"{f.name} lacks {key}"
        for name, workload in data["workloads"].items():
            assert workload["command"] and workload["steps"], f"{f.name}: {name}"
            for step, r in workload["steps"].items():
                assert r["tokens_per_s"] > 0 and r["ttft_median_ms"] > 0, f"{f.name}: {name} {step}"
    figures = json.loads((ROOT / "docs" / "data" / "figures.json").read_text())
    for name, entry in figures.items():
        assert entry["meta"]["command"].startswith("python docs/data/make_figures.py"), name


def test_chapters_quote_no_benchmark_table_by_hand():
    """Benchmark tables come from docs/data/ through markers; a hand-typed 'tokens/s' table column would drift."""
    for page in [*(ROOT / "docs" / "steps").glob("*.md"), ROOT / "docs" / "index.md",
                 ROOT / "docs" / "reference" / "benchmarks.md"]:
        for line in page.read_text().splitlines():
            if line.startswith("|") and re.search(r"tokens/s", line):
                pytest.fail(f"{page.name}: a hand-written benchmark table: {line}")


def test_every_step_has_a_chapter():
    nav = (ROOT / "mkdocs.yml").read_text()
    for step in STEPS:
        chapter = ROOT / "docs" / "steps" / f"{step}.md"
        assert chapter.is_file() and f"steps/{step}.md" in nav
        text = chapter.read_text()
        for heading in ("## The problem", "## The idea", "## The code", "## Proof", "## Result", "## Try it"):
            assert heading in text, f"{chapter} lacks {heading!r}"


def test_the_readme_quotes_the_measured_test_times():
    """The README's test times are those of docs/data/test_suite.json (python docs/data/measure_test_suite.py)."""
    suite = json.loads((ROOT / "docs" / "data" / "test_suite.json").read_text())
    readme = (ROOT / "README.md").read_text()
    assert suite["command"].startswith("python docs/data/measure_test_suite.py")
    for quoted in (f"{suite['full']['tests']:,} tests", f"in {suite['full']['minutes']} min",
                   f"{suite['fast']['tests']:,} tests in {suite['fast']['minutes']} min", f"{suite['ci']['minutes']} min"):
        assert quoted in readme, f"README.md should say {quoted!r} (docs/data/test_suite.json)"
