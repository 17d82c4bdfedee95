"""The linter's view of a tool's source: tree-sitter's TypeScript grammar (TSX for .tsx/.jsx),
the few walks and look-ups every check uses, and the fix texts it shares with the shim."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import tree_sitter
import tree_sitter_typescript

MAX_SOURCE_BYTES = 1 << 20  # the shim loads bigger files, but nobody hand-writes them

# One source for the fix texts: the shim's load-time errors read the same file (it ships in the image).
# fixes.json here is a link to images/node/shim/src/fixes.json, so an installed (not editable) sandboxd has a copy.
FIXES_FILE = Path(__file__).resolve().parent / "fixes.json"
_FIXES = json.loads(FIXES_FILE.read_text(encoding="utf-8"))
EXECUTE_SIGNATURE = f"'{_FIXES['executeSignature']}'"
EXPORT_FIX = _FIXES["exportFix"]
RETURN_FIX = _FIXES["returnFix"]

_TS = tree_sitter.Language(tree_sitter_typescript.language_typescript())
_TSX = tree_sitter.Language(tree_sitter_typescript.language_tsx())

Node = tree_sitter.Node
FUNCTIONS = frozenset({"function_declaration", "generator_function_declaration", "function_expression",
                        "function", "generator_function", "arrow_function", "method_definition"})
CLASSES = frozenset({"class_declaration", "abstract_class_declaration", "class"})
_WRAPPERS = frozenset({"parenthesized_expression", "as_expression", "satisfies_expression", "non_null_expression"})


def parse(text: str, name: str = "index.ts") -> Node:
    """The syntax tree's root; never raises (broken code gives ERROR nodes, which the checks pass over)."""
    data = text.encode("utf-8", errors="surrogatepass")  # lone surrogates: keep the byte offsets line-true
    language = _TSX if name.endswith((".tsx", ".jsx")) else _TS
    return tree_sitter.Parser(language).parse(data).root_node


def node_text(node: Node | None) -> str:
    return node.text.decode("utf-8", errors="replace") if node is not None and node.text is not None else ""


def line_of(node: Node) -> int:
    return node.start_point.row + 1


def walk(node: Node, into_functions: bool = True) -> Iterator[Node]:
    """Every node under ``node`` (not ``node`` itself), in source order."""
    stack = list(reversed(node.children))
    while stack:
        current = stack.pop()
        yield current
        if into_functions or current.type not in FUNCTIONS:
            stack.extend(reversed(current.children))


def unwrap(node: Node | None) -> Node | None:
    while node is not None and node.type in _WRAPPERS:
        node = node.named_children[0] if node.named_children else None
    return node


def top_level(root: Node) -> Iterator[Node]:
    """Top-level statements, with the declarations inside ``export`` statements."""
    for statement in root.named_children:
        yield statement
        declaration = statement.child_by_field_name("declaration") if statement.type == "export_statement" else None
        if declaration is not None:
            yield declaration


def local_definition(root: Node, name: str, kinds: frozenset[str] | None = None) -> Node | None:
    """The top-level declaration of ``name``: a function, a class, or a variable's declarator."""
    for statement in top_level(root):
        if statement.type in ("lexical_declaration", "variable_declaration"):
            if kinds is not None and "variable" not in kinds:
                continue
            for declarator in statement.named_children:
                if declarator.type == "variable_declarator" and node_text(declarator.child_by_field_name("name")) == name:
                    return declarator
        elif statement.type in FUNCTIONS | CLASSES and (kinds is None or statement.type in kinds):
            if node_text(statement.child_by_field_name("name")) == name:
                return statement
    return None


def string_value(node: Node) -> str:
    return "".join(node_text(c) for c in node.named_children if c.type in ("string_fragment", "escape_sequence"))


def name_of(node: Node | None) -> str:
    if node is None:
        return ""
    return string_value(node) if node.type == "string" else node_text(node)
