"""The README and docs/ hold together: every relative Markdown link in README.md and docs/*.md
names a file that exists (and, for `file#anchor` or `#anchor`, a heading of that file, with
GitHub's anchor rules), every docs page is linked from the README, and the README stays short
(≤ 250 lines: what dtrun is, the two commands, a job, the commands, a picture, the code map)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 250

_FENCE = re.compile(r"^\s*(```|~~~)")
_CODE_SPAN = re.compile(r"`+[^`\n]*`+")
_INLINE = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFDEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$")
_HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
_EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")  # http:, https:, mailto:, …


def _prose_lines(text: str):
    """(line number, line) outside fenced code blocks."""
    fenced = False
    for n, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield n, line


def links(text: str) -> list[tuple[int, str]]:
    """Every link target in Markdown ``text`` (inline, image and reference definitions), with its
    line; code blocks and code spans are not links."""
    out = []
    for n, line in _prose_lines(text):
        m = _REFDEF.match(line)
        if m:
            out.append((n, m.group(1)))
            continue
        for m in _INLINE.finditer(_CODE_SPAN.sub("", line)):
            out.append((n, m.group(1)))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: the rendered text, lower case, punctuation but hyphens and
    underscores dropped, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link renders as its text
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """The anchors GitHub gives ``text``'s headings (a repeated heading gets -1, -2, …)."""
    seen: dict[str, int] = {}
    out = set()
    for _n, line in _prose_lines(text):
        m = _HEADING.match(line)
        if not m:
            continue
        s = slug(m.group(2))
        if s in seen:
            seen[s] += 1
            s = f"{s}-{seen[s]}"
        else:
            seen[s] = 0
        out.add(s)
    return out


def broken_links(md: Path, root: Path = ROOT) -> list[str]:
    """What is wrong with ``md``'s relative links: a file that does not exist, a link that leaves
    the repository, an anchor no heading of the target has. Empty when every link resolves."""
    problems = []
    for n, target in links(md.read_text(encoding="utf-8")):
        if _EXTERNAL.match(target) or target.startswith("//"):
            continue  # external: not checked (no test reaches the internet)
        path, _, anchor = target.partition("#")
        dest = (md.parent / path).resolve() if path else md.resolve()
        where = f"{md.relative_to(root)}:{n}: {target}"
        if not dest.is_relative_to(root.resolve()):
            problems.append(f"{where} (outside the repository)")
        elif not dest.exists():
            problems.append(f"{where} (no such file)")
        elif anchor and dest.is_file() and dest.suffix == ".md" and anchor not in anchors(dest.read_text(encoding="utf-8")):
            problems.append(f"{where} (no heading with anchor #{anchor} in {dest.relative_to(root.resolve())})")
    return problems


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("md", _pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(md):
    assert broken_links(md) == []


def test_the_readme_is_at_most_250_lines_and_links_every_docs_page():
    readme = ROOT / "README.md"
    lines = readme.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines (at most {README_MAX_LINES})"
    docs = sorted((ROOT / "docs").glob("*.md"))
    assert docs, "docs/ holds the rest of the documentation"
    linked = {(readme.parent / t.partition("#")[0]).resolve() for _n, t in links(readme.read_text(encoding="utf-8"))
              if not _EXTERNAL.match(t) and t.partition("#")[0]}
    assert [str(d.relative_to(ROOT)) for d in docs if d.resolve() not in linked] == []


def test_the_checker_finds_a_broken_file_a_broken_anchor_and_ignores_code(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "ok.md").write_text("# Title\n\n## A `code` heading: with (punctuation)\n\n## Twice\n\n## Twice\n")
    page = tmp_path / "README.md"
    page.write_text(
        "# Top\n\n"
        "[fine](docs/ok.md) [anchor](docs/ok.md#a-code-heading-with-punctuation) [self](#top) "
        "[second](docs/ok.md#twice-1) [web](https://example.com/x.md) ![img](docs/ok.md)\n"
        "`[not a link](nowhere.md)`\n\n"
        "```\n[inside a fence](nowhere-either.md)\n```\n\n"
        "[gone](docs/missing.md) and [bad anchor](docs/ok.md#no-such-heading)\n"
        "[escape](../../etc/passwd)\n"
        "[ref]: docs/also-missing.md\n")
    problems = broken_links(page, root=tmp_path)
    assert len(problems) == 4, problems
    assert "README.md:10: docs/missing.md (no such file)" in problems[0]
    assert "#no-such-heading" in problems[1] and "no heading" in problems[1]
    assert "outside the repository" in problems[2]
    assert "docs/also-missing.md (no such file)" in problems[3]
    assert not any("nowhere" in p for p in problems)
    page.write_text("# Top\n\n[fine](docs/ok.md#twice) [self](#top)\n")
    assert broken_links(page, root=tmp_path) == []
