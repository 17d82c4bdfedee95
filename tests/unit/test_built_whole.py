"""Objects are built whole (issue 45, item 3): a constructor passes each part what it needs, and
never sets an attribute of a part it just made (``self.runner.storage = self.storage``).

A part wired after its construction can be used before the wiring, and a reader has to find
every place that completes it; passed in, its constructor says all it depends on.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "sandboxd"


def _targets(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        found = node.targets
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        found = [node.target]
    else:
        return []
    return [element for target in found for element in (target.elts if isinstance(target, ast.Tuple) else [target])]


def _wired_after(init: ast.FunctionDef | ast.AsyncFunctionDef) -> list[tuple[int, str]]:
    """Assignments in ``init`` to ``self.<part>.<attribute>``, with their lines."""
    return [(node.lineno, ast.unparse(target)) for node in ast.walk(init) if isinstance(node, ast.stmt)
            for target in _targets(node)
            if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Attribute)
            and isinstance(target.value.value, ast.Name) and target.value.value.id == "self"]


def test_no_constructor_wires_a_part_after_making_it() -> None:
    wired = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == "__init__":
                wired += [f"{path.relative_to(ROOT)}:{line} sets {target}" for line, target in _wired_after(node)]
    assert not wired, ("constructors that set an attribute of a part they made; pass it to the part's "
                       "constructor instead:\n  " + "\n  ".join(wired))
