"""The docs' shape (issue 45): the README lists each page once, performance.md stays a results
page a reader can take in (under 3,000 words, counted as `wc -w` counts), and CHANGELOG.md keeps
Keep a Changelog's sections, newest first.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PERFORMANCE_MAX_WORDS = 3000
CHANGE_KINDS = {"Added", "Changed", "Deprecated", "Removed", "Fixed", "Security"}
PAGE_ROW = re.compile(r"^\| \[[^\]]+\]\(([^)]+)\) \|", re.M)
SECTION = re.compile(r"^## \[([^\]]+)\]", re.M)
KIND = re.compile(r"^### (.+)$", re.M)


def readme_pages(readme: str) -> Counter[str]:
    """The pages the README's docs table lists, each with how often."""
    table = readme.split("\n## Docs\n", 1)[1].split("\n## ", 1)[0]
    return Counter(PAGE_ROW.findall(table))


def changelog_problems(text: str) -> list[str]:
    """What keeps ``text`` from Keep a Changelog's shape: [Unreleased] first, then dates, newest first."""
    sections = SECTION.findall(text)
    problems = [] if sections[:1] == ["Unreleased"] else ["the first section is not ## [Unreleased]"]
    dates = sections[1:]
    problems += [f"## [{date}] is not a date (YYYY-MM-DD)" for date in dates if not re.fullmatch(r"\d{4}-\d\d-\d\d", date)]
    if dates != sorted(dates, reverse=True):
        problems.append(f"the dated sections are not newest first: {dates}")
    problems += [f"### {kind} is none of {sorted(CHANGE_KINDS)}" for kind in KIND.findall(text) if kind not in CHANGE_KINDS]
    return problems


def test_the_readme_lists_each_page_once_and_the_changelog() -> None:
    listed = readme_pages((REPO / "README.md").read_text(encoding="utf-8"))
    pages = {f"docs/{path.name}" for path in (REPO / "docs").glob("*.md")} | {"CHANGELOG.md"}
    assert {page: n for page, n in listed.items() if n > 1} == {}, "a page listed more than once"
    assert pages - set(listed) == set(), "pages the README's docs table leaves out"


def test_performance_md_is_a_results_page_under_3000_words() -> None:
    words = len((REPO / "docs" / "performance.md").read_text(encoding="utf-8").split())
    assert words < PERFORMANCE_MAX_WORDS, (
        f"docs/performance.md has {words} words: keep today's figures there, and move a change's "
        "before and after to CHANGELOG.md")


def test_the_changelog_keeps_its_shape() -> None:
    assert changelog_problems((REPO / "CHANGELOG.md").read_text(encoding="utf-8")) == []
