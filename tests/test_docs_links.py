"""README.md and docs/*.md: every relative link resolves, every anchor names a heading; README stays short.

Fast and torch-free: it reads Markdown only. Anchors follow GitHub's slug rules (the heading's text,
lowercase, punctuation other than - and _ dropped, spaces to -, a repeated slug numbered -1, -2, ...).
"""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 260

LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(([^()\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
INLINE_CODE = re.compile(r"`+[^`]*`+")


def prose_lines(text: str):
    """The lines outside fenced code blocks."""
    fenced = False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield line


def slug(heading: str) -> str:
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading: its text
    text = text.lower().strip()
    text = re.sub(r"[^\w\- ]", "", text)  # \w keeps letters, digits and _
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in prose_lines(path.read_text(encoding="utf-8")):
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(path: Path):
    for number, line in enumerate(prose_lines(path.read_text(encoding="utf-8")), 1):
        for m in LINK.finditer(INLINE_CODE.sub("", line)):
            yield number, m.group(1)


def test_slug_rules():
    assert slug("Real processes: the collective runtime") == "real-processes-the-collective-runtime"
    assert slug("Reliability notes (the syncer)") == "reliability-notes-the-syncer"
    assert slug("DiLoCo's defining result (`python bench/fidelity.py --jobs 2`)") == (
        "dilocos-defining-result-python-benchfidelitypy---jobs-2")
    assert slug("Run folders, disks and bad input") == "run-folders-disks-and-bad-input"


def test_the_docs_exist():
    names = {p.name for p in DOCS}
    assert {"README.md", "usage.md", "runtimes.md", "deployment.md", "decoupled.md", "concepts.md",
            "reliability.md", "security.md", "architecture.md", "results.md"} <= names


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc: Path):
    broken = []
    for number, target in links(doc):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...: not checked here
            continue
        path_part, _, anchor = target.partition("#")
        dest = (doc.parent / path_part).resolve() if path_part else doc
        if not dest.exists():
            broken.append(f"line {number}: {target} (no such file or folder)")
            continue
        if anchor:
            if dest.is_dir() or dest.suffix != ".md":
                broken.append(f"line {number}: {target} (an anchor into a file that is not Markdown)")
            elif anchor not in anchors(dest):
                broken.append(f"line {number}: {target} (no heading with that anchor in {dest.name})")
    assert not broken, f"{doc.relative_to(ROOT)}:\n" + "\n".join(broken)


def test_readme_is_a_front_door():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move detail into docs/"
    ci = [line for line in (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
          if line.startswith("python -m pytest")]
    assert len(ci) == 1 and any(line.startswith(ci[0] + " ") for line in lines), "CI runs README's test command"
