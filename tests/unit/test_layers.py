"""The package's layers (docs/design.md, "Layers"): each package imports only its own modules and the
layers below it, and no module imports one that imports it back.

One rule for what an import is: at module level, inside a function and under ``if TYPE_CHECKING:``
alike. A function's import runs as surely as the module's, only later: it hides a cycle rather
than removing it. A type-only import still means neither module can be read without the other.

The counts for a closing note: ``python -m tests.unit.test_layers`` prints the package cycles and
the upward imports, each counted then listed (0 and 0 when this test passes).
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Bottom to top, as docs/design.md's "Layers" lists them. A layer's packages may import each
# other's lower layers only, never one beside them. "leaves" is every module right under
# sandboxd/; sandboxd/__main__.py, the entry point, is "__main__", on top.
LAYERS: list[tuple[str, ...]] = [
    ("leaves",),
    ("rules",),
    ("config",),
    ("service", "cluster"),  # cluster: the directory in etcd and the certificates' roles; it needs config only
    ("tools",),
    ("egress",),
    ("sandbox",),
    ("storage",),
    ("server",),
    ("mcp", "dev", "router"),  # router: one socket in front of every host, with the server's socket rules
    ("cli",),
    ("__main__",),
]


# -- the import graph ------------------------------------------------------------------------------


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(package: Path) -> dict[str, Path]:
    """Module name → its file, for every module of ``package``."""
    paths = (path for path in package.rglob("*.py") if "__pycache__" not in path.parts)
    return {module_name(path, package.parent): path for path in sorted(paths)}


def imports_of(name: str, source: str, is_package: bool, known: set[str]) -> dict[str, int]:
    """The known modules module ``name`` imports, each with the line of its first import.

    ``from a.b import c`` is an import of ``a.b.c`` when that is a module, else of ``a.b``. The
    parent packages an import runs on the way (``a``'s ``__init__``) are not counted, or every
    package re-exporting its modules would be a cycle with each of them.
    """
    package = name if is_package else name.rpartition(".")[0]
    found: dict[str, int] = {}

    def add(target: str, line: int) -> None:
        if target in known and target != name:
            found.setdefault(target, line)

    # ast.walk sees every node: a function's body and an ``if TYPE_CHECKING:`` block too.
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            for alias in node.names:
                add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base, node.lineno)
    return found


def import_graph(package: Path) -> dict[str, dict[str, int]]:
    """Module → the modules of ``package`` it imports (each with its line)."""
    paths = modules(package)
    known = set(paths)
    return {name: imports_of(name, path.read_text(encoding="utf-8"), path.name == "__init__.py", known)
            for name, path in paths.items()}


# -- layers ----------------------------------------------------------------------------------------


def units(package: Path) -> dict[str, str]:
    """Module name → the package it belongs to for the layers: ``sandboxd.egress.proxy`` → ``egress``."""
    found = {}
    for name, path in modules(package).items():
        parts = path.relative_to(package).parts
        found[name] = parts[0] if len(parts) > 1 else "__main__" if parts[0] == "__main__.py" else "leaves"
    return found


def level(name: str, layers: list[tuple[str, ...]]) -> int | None:
    return next((index for index, layer in enumerate(layers) if name in layer), None)


def upward_imports(graph: dict[str, dict[str, int]], unit: dict[str, str], layers: list[tuple[str, ...]]) -> list[str]:
    """Each import of a package beside or above the importer's, and each package in no layer, as a sentence."""
    found = []
    for module, targets in sorted(graph.items()):
        mine = unit[module]
        if level(mine, layers) is None:
            found.append(f"{module} is in package {mine!r}, which is in no layer: add it to LAYERS and docs/design.md")
            continue
        for target, line in sorted(targets.items()):
            theirs = unit[target]
            if theirs != mine and (level(theirs, layers) or 0) >= (level(mine, layers) or 0):
                found.append(f"{module} (line {line}) imports {target}: {theirs} is not below {mine}")
    return found


def package_graph(graph: dict[str, dict[str, int]], unit: dict[str, str]) -> dict[str, set[str]]:
    packages: dict[str, set[str]] = {}
    for module, targets in graph.items():
        packages.setdefault(unit[module], set()).update(unit[target] for target in targets)
    return {name: targets - {name} for name, targets in packages.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan): each a cycle or several."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = stack[stack.index(node):]
            del stack[stack.index(node):]
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


PACKAGE = ROOT / "sandboxd"


# -- the tests -------------------------------------------------------------------------------------


def test_each_package_imports_only_the_layers_below_it() -> None:
    upward = upward_imports(import_graph(PACKAGE), units(PACKAGE), LAYERS)
    assert not upward, ("imports against the layers (docs/design.md, \"Layers\"); move what both need into a "
                        "lower layer, or pass it in:\n  " + "\n  ".join(upward))


def test_no_module_imports_one_that_imports_it_back() -> None:
    graph = import_graph(PACKAGE)
    found = cycles({module: set(targets) for module, targets in graph.items()})
    assert not found, "import cycles among modules; move what they share below them:\n  " + "\n  ".join(
        " ⇄ ".join(component) for component in found)


def test_the_check_sees_type_checking_and_function_imports(tmp_path: Path) -> None:
    # A fake package whose low layer imports its high one twice: for a type, and in a function.
    package = tmp_path / "sandboxd"
    for folder in ("low", "high"):
        (package / folder).mkdir(parents=True)
        (package / folder / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "low" / "a.py").write_text("from typing import TYPE_CHECKING\n"
                                           "if TYPE_CHECKING:\n    from sandboxd.high.b import B\n"
                                           "def f():\n    from ..high import c\n")
    (package / "high" / "b.py").write_text("from sandboxd.low.a import f\nB = 1\n")
    (package / "high" / "c.py").write_text("")
    graph, unit = import_graph(package), units(package)
    assert graph["sandboxd.low.a"] == {"sandboxd.high.b": 3, "sandboxd.high.c": 5}
    assert upward_imports(graph, unit, [("leaves",), ("low",), ("high",)]) == [
        "sandboxd.low.a (line 3) imports sandboxd.high.b: high is not below low",
        "sandboxd.low.a (line 5) imports sandboxd.high.c: high is not below low"]
    assert upward_imports(graph, unit, [("leaves",), ("low", "high")])[0].endswith("low is not below high")
    assert upward_imports(graph, unit, [("leaves",), ("low",)])[-1].startswith("sandboxd.high.c is in package 'high', "
                                                                        "which is in no layer")
    assert cycles({module: set(targets) for module, targets in graph.items()}) == [["sandboxd.high.b",
                                                                                   "sandboxd.low.a"]]
    assert cycles(package_graph(graph, unit)) == [["high", "low"]]


def report() -> str:
    """The package cycles and the upward imports in sandboxd today, counted then listed."""
    graph, unit = import_graph(PACKAGE), units(PACKAGE)
    package_cycles, upward = cycles(package_graph(graph, unit)), upward_imports(graph, unit, LAYERS)
    lines = [f"package cycles: {len(package_cycles)}", *(f"  {' ⇄ '.join(found)}" for found in package_cycles),
             f"upward imports: {len(upward)}", *(f"  {found}" for found in upward)]
    return "\n".join(lines)


if __name__ == "__main__":
    print(report())
