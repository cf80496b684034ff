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

# The site is built once per process (the module fixture `site`, a mkdocs build of about 17 s): the file's tests run
# on one pytest-xdist worker (--dist loadgroup), not spread over two that would each build it.
pytestmark = pytest.mark.xdist_group("docs_site")


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
            # the generated diff: engine.py's, or engine.py in its list of files the step leaves as they were
            assert (f"steps/{STEPS[i - 1]}/engine.py" in page
                    or re.search(r"Unchanged:[^\n]*<code>engine\.py</code>", page)), f"{step}'s chapter lacks the generated diff"
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
        leftover = re.findall(r"<!--\s*(bench-[a-z]+|figure|fig-[a-z]+|step-[a-z]+|suite-[a-z]+|data|calc|raw|raw-block):", text)
        assert not leftover, f"{path}: unrendered markers {leftover}"
        for src in re.findall(r'<img class="figure" src="([^"]+)"', text):
            assert (path.parent / src).resolve().is_file(), f"{path}: missing figure {src}"
    svgs = list((site / "figures").glob("*.svg"))
    assert {p.stem for p in svgs} >= {"tokens-per-s", "ms-per-token", "batch-size", "timeline", "utilisation"}
    home = (site / "index.html").read_text()
    assert "figures/tokens-per-s.svg" in home


def _reader_text(page: str) -> str:
    """What a reader reads on a page: its prose and tables, without code, scripts, styles and plots."""
    page = re.sub(r"<(pre|code|script|style|svg)\b.*?</\1>", " ", page, flags=re.S)
    return html.unescape(re.sub(r"<[^>]+>", " ", page))


# A number with more than 4 decimals after its point (leading zeros of a number under 1 not counted), outside
# arXiv and DOI identifiers (after ":" or "/").
LONG_NUMBER = re.compile(r"(?<![\w.:/])(\d[\d,]*)\.(\d+)(?![\w.])")


def long_numbers(text: str) -> list[str]:
    found = []
    for m in LONG_NUMBER.finditer(text):
        decimals = m.group(2).lstrip("0") if not m.group(1).strip("0,") else m.group(2)
        if len(decimals) > 4:
            found.append(m.group(0))
    return found


def test_long_numbers_are_found():
    assert long_numbers("step20 took 16.954222025440323 ms, 478.23522613910507 tokens/s") == [
        "16.954222025440323", "478.23522613910507"]
    assert long_numbers("0.2897 ms, 1,851.7 tokens/s, 0.000123, arXiv:2309.06180, doi:10.1145/1498765.1498785") == []


def test_no_page_prints_a_raw_float(site):
    """Every figure from docs/data/ goes through one formatter (docs/hooks/figures.py's fmt): the prose and tables
    never show a float as the JSON holds it (16.954222025440323 ms)."""
    raw = {str(p.relative_to(site)): found for p, text in _pages(site).items()
           if (found := long_numbers(_reader_text(text)))}
    assert not raw, f"numbers with more than 4 decimals (format them in docs/hooks/figures.py): {raw}"


# Words about how the pages were made, which a reader has no use for: a page says which run a figure is from, on
# which device and with which command, not how the work on the site was organised.
HOW_IT_WAS_MADE = ("session", "the call allowed", "machine lent", "lent for", "lent machine", "in our runs",
                   "no network", "came after this run", "did not fit in the", "failed in this call", "in this call",
                   "device call", "device time", "the same call", "what was asked", "was requested", "the brief",
                   "in other jobs", "with this step in the tree", "on this chapter's cpu", "an earlier call",
                   "another call", "a cpu test caught it", "earlier_call")
# Not listed: "one call", which the chapters use for a function called once ("the sampler takes the whole step's batch
# in one call"), not only for a run on a device.


def how_it_was_made(text: str) -> list[str]:
    low = " ".join(text.lower().split())
    # A word's ends are bounded by anything but a letter or a digit, so that "earlier_call" is found inside a file
    # name (h200_..._earlier_call.txt), where \b would see no boundary at the underscore.
    return [w for w in HOW_IT_WAS_MADE if re.search(rf"(?<![a-z0-9]){re.escape(w)}(?![a-z0-9])", low)]


def test_how_it_was_made_is_found():
    assert how_it_was_made("steps 10-14_6 did not fit in the session's\ndevice time") == [
        "session", "did not fit in the", "device time"]
    assert how_it_was_made("step18 came after this run; the GPU machine lent for this chapter") == [
        "machine lent", "lent for", "came after this run"]
    assert how_it_was_made("one job on the H200, with python -m shared.bench") == []
    assert how_it_was_made("measured in other jobs (an earlier call; see h200_step27_spec_graphs_earlier_call.txt),\n"
                           "with this step in the tree on this chapter's CPU (a CPU test caught it)") == [
        "in other jobs", "with this step in the tree", "on this chapter's cpu", "an earlier call",
        "a cpu test caught it", "earlier_call"]
    assert how_it_was_made("another call of _make_room") == ["another call"]
    assert how_it_was_made("the sampler takes the whole step's batch in one call") == []


def test_no_page_speaks_of_how_it_was_made(site):
    """The built pages, their captions, table notes and inline code included (code listings and diffs are the
    engine's source), carry none of HOW_IT_WAS_MADE."""
    found = {}
    for path, text in _pages(site).items():
        page = re.sub(r"<(pre|script|style|svg)\b.*?</\1>", " ", text, flags=re.S)
        words = how_it_was_made(html.unescape(re.sub(r"<[^>]+>", " ", page)))
        if words:
            found[str(path.relative_to(site))] = words
    assert not found, f"pages that speak of how they were made: {found}"


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
    devices = [f for f in files if f.name not in ("figures.json", "test_suite.json", "first_demo.json")]
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


def _figures_hook():
    import importlib.util

    spec = importlib.util.spec_from_file_location("figures_hook", ROOT / "docs" / "hooks" / "figures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_one_measurement_one_value_across_pages(site):
    """Every figure the pages quote from a benchmark run is in the ledger the build writes (quotes.json), with the
    measurement it is of. A measurement quoted with two values is allowed only where each value that is not from
    the site's own run names its run; the build checks it (and fails), and so does this test, on the ledger."""
    quotes = json.loads((site / "quotes.json").read_text())
    assert _figures_hook().check_quotes(quotes) == []
    # The summaries quote the site's run of every step, on the home page and on the benchmarks page.
    # A step newer than the run is named in the run's "pending" (the tables show it as not measured).
    pending = set(json.loads((ROOT / "docs" / "data" / "h200.json").read_text())["workloads"]["mixed"].get("pending", {}))
    # Five while the all-steps run waits for an H200 (steps 29-33 were built without one); back to three once it runs.
    assert pending <= set(STEPS[-7:]), f"only the newest steps may wait for the all-steps run: {sorted(pending)}"
    for page in ("index.md", "reference/benchmarks.md"):
        quoted = {q["measurement"][6] for q in quotes if q["page"] == page and q["canonical"]
                  and q["measurement"][:2] == ["h200", "mixed"] and q["measurement"][7] == "tokens_per_s"}
        assert set(STEPS) - pending <= quoted, f"{page} lacks the all-steps run of {sorted(set(STEPS) - quoted)}"
    pages = {q["page"] for q in quotes}
    assert len(pages) > 10, pages


def test_the_quote_check_fails_on_two_values_of_one_measurement():
    hook = _figures_hook()
    m = ["h200", "mixed", "random:smollm2-135m", 128, 16, "", "step09", "tokens_per_s"]
    site_run = {"page": "index.md", "measurement": m, "run": "the all-steps run", "canonical": True, "value": "78.0",
                "labelled": False}
    other = {"page": "steps/step10.md", "measurement": m, "run": "Part 4's run", "canonical": False, "value": "98.4",
             "labelled": False}
    problems = hook.check_quotes([site_run, other])
    assert len(problems) == 1 and "step10.md" in problems[0] and "98.4" in problems[0] and "78.0" in problems[0]
    assert hook.check_quotes([site_run, dict(other, labelled=True)]) == []  # it says which run: allowed
    assert hook.check_quotes([site_run, dict(other, value="78.0")]) == []  # the same value: nothing to reconcile
    two_sites = [site_run, dict(site_run, page="steps/step09.md", value="70.2")]
    assert len(hook.check_quotes(two_sites)) == 1  # two runs both called the site's own: a data error
    assert hook.check_quotes([site_run, dict(other, measurement=m[:4] + [64] + m[5:])]) == []  # another measurement


# A measured figure typed into prose would drift from docs/data/; these units are what the benchmarks measure.
TYPED_FIGURE = re.compile(r"(?<![\w.{])\d[\d,]*(?:\.\d+)?\s?(?:tokens/s|GB/s|TB/s|TFLOP/s)"
                          r"|(?<![\w.])\d+(?:\.\d+)?%\s+of\s+(?:the\s+)?(?:measured\s+)?copy\s+bandwidth"
                          r"|(?<![\w.])\d+(?:\.\d+)?x\s+(?:faster|slower)"
                          r"|\babout\s+\d[\d,]*(?:\.\d+)?\s+(?:kernels|launches|ms)\b"
                          r"|(?<![\w.{])\d[\d,]*\s+(?:\[)?(?:kernels|kernel launches)\b")


def typed_figures(text: str) -> list[str]:
    """Measured-looking figures typed into a page's prose and tables: outside code blocks and markers. A line that
    quotes a datasheet (a published limit, not a measurement) is not counted."""
    found, in_code = [], False
    for n, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            in_code = not in_code
            continue
        if in_code or "datasheet" in line:
            continue
        for m in TYPED_FIGURE.finditer(re.sub(r"<!--.*?-->", "", line)):
            found.append(f"line {n}: {m.group(0)!r}")
    return found


def test_typed_figures_are_found():
    assert typed_figures("step09 made 98.4 tokens/s") == ["line 1: '98.4 tokens/s'"]
    assert typed_figures("at 93% of the copy bandwidth, 1.28x faster") == [
        "line 1: '93% of the copy bandwidth'", "line 1: '1.28x faster'"]
    assert typed_figures("<!-- bench-value: h200 mixed step09 tokens_per_s --> tokens/s") == []
    assert typed_figures("```text\n98.4 tokens/s\n```") == []
    assert typed_figures("NVIDIA's datasheet says 4.8 TB/s") == []
    assert typed_figures("step20's host launched about 370 [kernels](glossary.md#kernel)") == ["line 1: '370 [kernels'"]
    assert typed_figures("about 360 launches") == ["line 1: 'about 360 launches'"]


def test_no_page_has_typed_figures():
    """Every benchmark figure in the pages' prose comes from docs/data/ through a marker (a data, calc, raw,
    bench-value or bench-ratio marker inline; tables and plots from theirs). Program output in code blocks is
    exempt: it is the output of the command shown with it."""
    typed = {}
    for page in sorted((ROOT / "docs").rglob("*.md")):
        found = typed_figures(page.read_text())
        if found:
            typed[str(page.relative_to(ROOT))] = found
    assert not typed, "typed figures (use a marker, docs/hooks/figures.py):\n" + "\n".join(
        f"{page}: {', '.join(f)}" for page, f in typed.items())


def test_glossary_links_point_at_its_terms(site):
    """Chapters link a term's first use to the glossary; every such link lands on a heading that exists."""
    ids = set(re.findall(r'id="([^"]+)"', (site / "reference" / "glossary" / "index.html").read_text()))
    links = [(page.name, a) for page in (ROOT / "docs").rglob("*.md")
             for a in re.findall(r"glossary\.md#([\w-]+)", page.read_text())]
    assert len({page for page, _ in links}) >= len(STEPS) // 2, "the chapters hardly link the glossary"
    assert [link for link in links if link[1] not in ids] == []


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


def test_the_readme_quotes_the_measured_first_demo():
    """The README's time for a newcomer's first `make demo` is docs/data/first_demo.json's (a fresh clone, timed
    phase by phase by python3 docs/data/measure_first_demo.py)."""
    demo = json.loads((ROOT / "docs" / "data" / "first_demo.json").read_text())
    readme = (ROOT / "README.md").read_text()
    assert demo["command"].startswith("python3 docs/data/measure_first_demo.py")
    phases = {p["phase"]: p["seconds"] for p in demo["phases"]}
    setup = sum(phases[name] for name in ("virtual environment", "torch", "this project and its dependencies",
                                          "the embedded model's wheel"))
    conversion, run = phases["run.py: the model's conversion (once)"], phases["run.py: the demo"]
    for quoted in (f"`make demo` took {demo['wall_s']:.0f} s", f"the set-up {setup:.0f} s",
                   f"the model's conversion {conversion:.0f} s", f"the demo itself {run:.0f} s"):
        assert quoted in readme, f"README.md should say {quoted!r} (docs/data/first_demo.json)"
