"""The daemon's structure, checked like its behaviour (issue 37): no function too tangled to
follow, no module too long to hold in mind. Imports (layers, cycles) are tests/unit/test_layers.py's.

Each check names what breaks it and where. The allow-lists hold what is known and owned
elsewhere; they only shrink: an entry that no longer needs its room fails the test too, so
the list says the truth.
"""

from __future__ import annotations

from pathlib import Path

from radon.complexity import cc_visit

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "sandboxd"

# Radon's grade C ends at 20: above it a function has more paths than a reader can hold.
MAX_COMPLEXITY = 20
# Exceptions, each with the reason it cannot be simpler yet: none. {"path:function": its complexity now}
COMPLEXITY_ALLOWED: dict[str, int] = {
}

MAX_LINES = 500
# Exceptions, each with the reason it cannot be split yet: none. {path: its line count now, at most}
LINES_ALLOWED: dict[str, int] = {
}


def modules() -> list[Path]:
    return sorted(path for path in PACKAGE.rglob("*.py") if "__pycache__" not in path.parts)


def relative(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def test_no_function_is_above_a_complexity_of_20() -> None:
    found: dict[str, tuple[int, int]] = {}  # "path:function" → (line, complexity)
    for path in modules():
        for block in cc_visit(path.read_text(encoding="utf-8")):
            name = f"{block.classname}.{block.name}" if getattr(block, "classname", None) else block.name
            found[f"{relative(path)}:{name}"] = (block.lineno, block.complexity)
            for closure in getattr(block, "closures", []):
                found[f"{relative(path)}:{name}.{closure.name}"] = (closure.lineno, closure.complexity)
    over = [f"{key.split(':')[0]}:{line} {key.split(':')[1]} has a cyclomatic complexity of {complexity}"
            for key, (line, complexity) in sorted(found.items())
            if complexity > COMPLEXITY_ALLOWED.get(key, MAX_COMPLEXITY)]
    assert not over, (f"functions above a complexity of {MAX_COMPLEXITY} (radon's grade C); split them into named "
                      "steps:\n  " + "\n  ".join(over))
    stale = [f"{key} (now {found[key][1] if key in found else 'gone'})" for key, allowed in COMPLEXITY_ALLOWED.items()
             if key not in found or found[key][1] < allowed]
    assert not stale, "COMPLEXITY_ALLOWED lists more than is there; lower or remove: " + ", ".join(stale)


def test_no_module_is_over_500_lines() -> None:
    lines = {relative(path): len(path.read_text(encoding="utf-8").splitlines()) for path in modules()}
    over = [f"{path} has {count} lines" for path, count in sorted(lines.items())
            if count > LINES_ALLOWED.get(path, MAX_LINES)]
    assert not over, f"modules over {MAX_LINES} lines; split them by concern:\n  " + "\n  ".join(over)
    stale = [f"{path} (now {lines.get(path, 'gone')})" for path in LINES_ALLOWED
             if lines.get(path, 0) <= MAX_LINES]
    assert not stale, "LINES_ALLOWED lists modules no longer over the limit; remove: " + ", ".join(stale)
