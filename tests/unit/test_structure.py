"""The daemon's structure, checked like its behaviour (issue 37): no function too tangled to
follow, no import cycle, no module too long to hold in mind.

Each check names what breaks it and where. The allow-lists hold what is known and owned
elsewhere; they only shrink: an entry that no longer needs its room fails the test too, so
the list says the truth.
"""

from __future__ import annotations

import ast
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


# -- import cycles -----------------------------------------------------------------------------


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, known: set[str]) -> dict[str, int]:
    """The sandboxd modules ``path`` imports, each with the line of its first import.

    Counted: imports at module level, inside functions and under ``if TYPE_CHECKING:`` alike (a
    function's import runs as surely as the module's, only later: it hides a cycle rather than
    removing it; a type-only import still means neither module can be read without the other, as
    sandbox/backend.py and tools/transpile_cache.py could not, issue 37). ``from a.b import c`` is an
    import of ``a.b.c`` when that is a module, else of ``a.b``; the parent packages an import
    runs on the way (``a``'s ``__init__``) are not counted, or every package re-exporting its
    modules would be a cycle with each of them.
    """
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: dict[str, int] = {}

    def add(target: str, line: int) -> None:
        if target in known and target != name:
            found.setdefault(target, line)

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                for alias in child.names:
                    add(alias.name, child.lineno)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package.rsplit(".", child.level - 1)[0] if child.level > 1 else package
                    base = f"{anchor}.{base}" if base else anchor
                for alias in child.names:
                    add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base, child.lineno)
            visit(child)

    visit(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)))
    return found


def import_graph() -> dict[str, dict[str, int]]:
    paths = {module_name(path): path for path in modules()}
    known = set(paths)
    return {name: imports_of(path, known) for name, path in paths.items()}


def find_cycle(graph: dict[str, dict[str, int]]) -> list[str] | None:
    """One cycle of ``graph`` as the modules along it (first == last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def walk(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph.get(node, {})):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state:
                cycle = walk(target)
                if cycle:
                    return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            cycle = walk(start)
            if cycle:
                return cycle
    return None


def test_no_import_cycles_among_sandboxds_modules() -> None:
    graph = import_graph()
    cycle = find_cycle(graph)
    if cycle:
        hops = [f"{a} imports {b} (line {graph[a][b]})" for a, b in zip(cycle, cycle[1:])]
        raise AssertionError("an import cycle; move what both need into a module below them, or pass it in:\n  "
                             + "\n  ".join(hops))


def test_the_cycle_finder_finds_a_cycle_and_the_graph_sees_imports_in_functions() -> None:
    # The check above can fail: a cycle through a function's import is found and reported.
    assert find_cycle({"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3}, "d": {"a": 4}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b": 1}, "b": {}}) is None
    graph = import_graph()
    assert "sandboxd.sandbox.pool" in graph["sandboxd.server.calls.runner"]
    assert "sandboxd.tools.discovery" in graph["sandboxd.sandbox.backend"]  # under TYPE_CHECKING: counted too
