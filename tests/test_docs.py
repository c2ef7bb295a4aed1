"""The documentation: the MkDocs site builds in strict mode, and the README stays a short front page
whose links into docs/ resolve (a few seconds; no job runs)."""

import os
import re
import subprocess
import sys
from pathlib import Path

from markdown.extensions.toc import slugify

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 200
# [text](target) and ![alt](target); the target up to the first space or closing parenthesis
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
CODE = re.compile(r"```.*?```", re.S)


def _anchors(page: Path) -> set[str]:
    """The heading ids MkDocs' toc extension gives `page` (default slugify, no duplicates kept apart)."""
    text = CODE.sub("", page.read_text(encoding="utf-8"))
    return {slugify(m.group(1).strip(), "-") for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*\s*$", text, re.M)}


def test_site_builds_in_strict_mode(tmp_path):
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    out = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
         "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert (tmp_path / "site" / "index.html").is_file()
    assert (tmp_path / "site" / "config" / "index.html").is_file()


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines (at most {README_MAX_LINES}): move text to docs/"


def test_readme_links_into_docs_resolve():
    text = CODE.sub("", (ROOT / "README.md").read_text(encoding="utf-8"))
    targets = [t for t in LINK.findall(text) if t.startswith("docs/")]
    assert targets, "README.md links to no docs/ page"
    broken = []
    for target in targets:
        path, _, anchor = target.partition("#")
        file = ROOT / path
        if not file.is_file():
            broken.append(f"{target}: no file {path}")
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
            broken.append(f"{target}: no heading with id #{anchor} in {path}")
    assert not broken, "README.md links that do not resolve:\n" + "\n".join(broken)


def test_readme_keeps_the_two_commands():
    """CI (.ci/run) and the docs name these commands: `make demo` and `make test`."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert re.search(r"^make demo\s+#", text, re.M) and re.search(r"^make test\s+#", text, re.M)
