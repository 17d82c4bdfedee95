"""README.md and docs/*.md are written in plain sentences: per file, the median sentence has at
most 18 words and none has more than 50 (issue 38).

Sentences are counted the way a reader meets them: fenced code, table rows and headings are
skipped; a link counts as its text and inline code as its words; a list item is a sentence
of its own (or several); a sentence ends at `.`, `!` or `?` followed by a space or a line end,
but not after an abbreviation such as "e.g." or inside a number such as 0.5.
Run this file as a script to see each page's distribution and its longest sentences.
"""

from __future__ import annotations

import re
import statistics
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = sorted([REPO / "README.md", *(REPO / "docs").glob("*.md")])
MEDIAN_MAX = 18
LONGEST_MAX = 50

FENCE = re.compile(r"^\s*(```|~~~)")
LIST_ITEM = re.compile(r"^\s*(?:[-*+]|\d+[.)])\s+")
LINK = re.compile(r"!?\[([^\]\n]*)\]\([^)\n]*\)")
CODE = re.compile(r"`([^`\n]*)`")
HTML = re.compile(r"<!--.*?-->|</?[a-zA-Z][^>\n]*>", re.S)
ABBREVIATIONS = {"e.g.", "i.e.", "vs.", "cf."}  # a dot that ends no sentence (etc. often does)
# A sentence ends at . ! or ? (and any closing quote or bracket) followed by white space.
END = re.compile(r"(?<=[.!?])[\"')\]*_]*\s+")
WORD = re.compile(r"[A-Za-z0-9]")


def blocks(text: str) -> list[str]:
    """The page's prose as blocks (paragraphs and list items), code, tables and headings left out."""
    out: list[str] = []
    current: list[str] = []
    in_fence = False
    quoted = False  # the block is a quote: its next "> " line goes on with it

    def flush() -> None:
        if current:
            out.append(" ".join(current))
            current.clear()

    for line in text.splitlines():
        if FENCE.match(line):
            flush()
            in_fence = not in_fence
            continue
        stripped = line.strip()
        if in_fence or not stripped or stripped.startswith(("|", "#")):
            flush()
            continue
        if stripped.startswith(">"):
            if not quoted:
                flush()
            quoted, stripped = True, stripped.lstrip("> ")
        elif quoted:
            flush()
            quoted = False
        if LIST_ITEM.match(stripped):
            flush()
            stripped = LIST_ITEM.sub("", stripped, count=1)
        current.append(stripped)
    flush()
    return out


def plain(block: str) -> str:
    """What a reader reads: links as their text, code as its words (its dots ending nothing)."""
    block = HTML.sub(" ", block)
    block = LINK.sub(r"\1", block)
    return CODE.sub(lambda m: m.group(1).replace(".", "\u2024").replace("!", "\u01c3").replace("?", "\u0294"), block)


def split(block: str) -> list[str]:
    """The block's sentences, ends not taken after an abbreviation."""
    sentences: list[str] = []
    start = 0
    for end in END.finditer(block):
        before = block[start:end.start()]
        last = before.split()[-1] if before.split() else ""
        if last.lower().lstrip("(\"'") in ABBREVIATIONS:
            continue
        sentences.append(before)
        start = end.end()
    sentences.append(block[start:])
    return [s.strip() for s in sentences if WORD.search(s)]


def words(sentence: str) -> int:
    return sum(1 for token in sentence.split() if WORD.search(token))


def sentences(path: Path) -> list[str]:
    return [s for block in blocks(path.read_text(encoding="utf-8")) for s in split(plain(block))]


def test_the_documents_are_found() -> None:
    names = {str(p.relative_to(REPO)) for p in DOCS}
    assert {"README.md", "docs/design.md", "docs/security.md"} <= names


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_sentences_are_plain(doc: Path) -> None:
    found = sentences(doc)
    assert found, f"{doc.relative_to(REPO)}: no sentence found (is the counter reading it?)"
    counts = [words(s) for s in found]
    median = statistics.median(counts)
    too_long = [f"{n} words: {s[:120]}" for s, n in zip(found, counts) if n > LONGEST_MAX]
    problems = []
    if median > MEDIAN_MAX:
        problems.append(f"median sentence {median} words (at most {MEDIAN_MAX}): split the longest ones")
    if too_long:
        problems.append(f"{len(too_long)} sentence(s) over {LONGEST_MAX} words (split each in two or more):\n  "
                        + "\n  ".join(too_long))
    assert not problems, f"{doc.relative_to(REPO)}: " + "\n".join(problems)


def test_the_counter_reads_as_a_reader_does(tmp_path: Path) -> None:
    doc = tmp_path / "doc.md"
    doc.write_text(
        "# A heading that is not counted\n\n"
        "The pool keeps sandboxes warm, e.g. for 0.5 s. See [the shim](shim.md) and `a.b.c`! Why?\n"
        "It wraps\nover two lines.\n\n"
        "| a | table. Row. |\n|---|---|\n\n"
        "```\nnot. counted. code.\n```\n\n"
        "- a list item\n- another, with two. Sentences here\n\n"
        "> A quote that\n> goes on.\n"
    )
    assert sentences(doc) == [
        "The pool keeps sandboxes warm, e.g. for 0.5 s.",
        "See the shim and a\u2024b\u2024c!",
        "Why?",
        "It wraps over two lines.",
        "a list item",
        "another, with two.",
        "Sentences here",
        "A quote that goes on.",
    ]
    assert [words(s) for s in sentences(doc)] == [9, 5, 1, 5, 3, 3, 2, 5]


if __name__ == "__main__":
    # A measurement, not a test: each page's median and longest, worst sentences first.
    top = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    for doc in DOCS:
        found = sentences(doc)
        counts = [words(s) for s in found]
        over = sum(1 for n in counts if n > LONGEST_MAX)
        print(f"{doc.relative_to(REPO)}: {len(found)} sentences, median {statistics.median(counts)}, "
              f"max {max(counts)}, {over} over {LONGEST_MAX}")
        for n, s in sorted(zip(counts, found), reverse=True)[:top]:
            print(f"   {n:4}  {s[:150]}")
