"""Every relative link in README.md, docs/ and clients/*/README.md resolves inside the repo.

A clone holds only this repository: a link that climbs out of it (to the shared spec a
developer's machine happens to have beside it) is dead for everyone else. A link to a
heading (`file.md#heading`) must name a heading of that file, spelled as GitHub spells
its anchors.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = sorted([REPO / "README.md", *(REPO / "docs").glob("*.md"), *(REPO / "clients").glob("*/README.md"),
               *(REPO / "clients").glob("*/examples/README.md")])

FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"\[[^\]\n]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)


def links(path: Path) -> list[str]:
    text = CODE.sub("", FENCE.sub("", path.read_text(encoding="utf-8")))
    return [target for target in LINK.findall(text) if not re.match(r"[a-z][a-z0-9+.-]*:", target, re.I)]


def anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens, repeats numbered."""
    found: set[str] = set()
    text = FENCE.sub("", path.read_text(encoding="utf-8"))
    for heading in HEADING.findall(text):
        plain = re.sub(r"[`*]|\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
        slug = re.sub(r"[^\w\- ]", "", plain).replace(" ", "-")
        candidate, n = slug, 1
        while candidate in found:
            candidate, n = f"{slug}-{n}", n + 1
        found.add(candidate)
    return found


def test_the_documents_are_found() -> None:
    names = {str(p.relative_to(REPO)) for p in DOCS}
    assert {"README.md", "docs/tools.md", "clients/pi/README.md", "clients/typescript/README.md"} <= names


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves_inside_the_repo(doc: Path) -> None:
    broken = []
    for target in links(doc):
        file_part, _, anchor = target.partition("#")
        resolved = (doc.parent / file_part).resolve() if file_part else doc
        if not resolved.is_relative_to(REPO):
            broken.append(f"{target}: leaves the repository (a clone has only this repo; link a file in it)")
        elif not resolved.exists():
            broken.append(f"{target}: {resolved.relative_to(REPO)} does not exist")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target}: {resolved.relative_to(REPO)} has no heading #{anchor}")
    assert not broken, f"{doc.relative_to(REPO)}: " + "; ".join(broken)


def test_the_checker_sees_a_link_that_leaves_the_repo_and_a_missing_heading(tmp_path: Path) -> None:
    doc = tmp_path / "doc.md"
    doc.write_text("# Top\n\n## The sandbox uid\n\nSee [spec](../shared/spec/TOOLS.md), `[not](a-link.md)`, "
                   "[here](#the-sandbox-uid) and [gone](#nowhere).\n\n```\n[also](not-a-link.md)\n```\n")
    assert links(doc) == ["../shared/spec/TOOLS.md", "#the-sandbox-uid", "#nowhere"]
    assert anchors(doc) == {"top", "the-sandbox-uid"}
    assert "dangerous-settings-allow_unsafe" in anchors(REPO / "docs" / "config.md")
