"""The docs site builds with --strict, and every step has a chapter that shows its generated diff."""
import subprocess
import sys

from conftest import ROOT, STEPS


def test_mkdocs_build_strict(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for i, step in enumerate(STEPS):
        page = (tmp_path / "site" / "steps" / step / "index.html").read_text()
        assert "engine.py" in page
        if i > 0:
            assert f"steps/{STEPS[i - 1]}/engine.py" in page, f"{step}'s chapter lacks the generated diff"
    # Offline: no page pulls scripts, styles or fonts from elsewhere.
    for html in (tmp_path / "site").rglob("*.html"):
        text = html.read_text()
        assert "fonts.googleapis.com" not in text and "cdn.jsdelivr" not in text and "unpkg.com" not in text, html


def test_every_step_has_a_chapter():
    nav = (ROOT / "mkdocs.yml").read_text()
    for step in STEPS:
        chapter = ROOT / "docs" / "steps" / f"{step}.md"
        assert chapter.is_file() and f"steps/{step}.md" in nav
        text = chapter.read_text()
        for heading in ("## The problem", "## The idea", "## The code", "## Proof", "## Result", "## Try it"):
            assert heading in text, f"{chapter} lacks {heading!r}"
