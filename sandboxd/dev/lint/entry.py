"""Checks of a tool's entry file for the common mistakes (docs/tool-development.md, "Check").

The source (TypeScript or JavaScript) is parsed with tree-sitter's TypeScript
grammar (TSX for .tsx/.jsx), so each check looks at a syntax tree: nothing
inside a comment, string, template or regex can look like code. Where the
source does something the checks cannot see through (``export *``, execute
built by a call), they stay silent rather than guess.

Every finding is a ``Problem`` with the file, the line, what is wrong and the
fix. ``field`` holds the check's id (``execute-export``, ``class-pattern``,
``cli-entry-point``, ``module-exports``, ``console-log``, ``bun-api``,
``throw``, ``no-return``, ``implicit-return``) so machines can tell the
findings apart.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from sandboxd.dev.lint.exports import (
    Exports,
    ModuleReader,
    execute_function,
    find_exports,
    follow_execute,
    read_sibling_module,
)
from sandboxd.dev.lint.returns import return_checks
from sandboxd.dev.lint.syntax import (
    EXPORT_FIX,
    FUNCTIONS,
    MAX_SOURCE_BYTES,
    Node,
    line_of,
    local_definition,
    node_text,
    parse,
    string_value,
    walk,
)
from sandboxd.tools.problem import Problem


@dataclass
class _Findings:
    """The problems found so far; ``where`` is the file execute's findings are in: the entry, or the
    module it re-exports execute from."""

    where: Path
    problems: list[Problem] = field(default_factory=list)

    def add(self, node: Node | None, check: str, message: str, fix: str, severity: str = "error",
            line: int | None = None) -> None:
        line = line if line is not None else line_of(node) if node is not None else 1  # None: the whole file
        self.problems.append(Problem(self.where, message, fix, field=check, line=line,
                                     severity=severity))  # type: ignore[arg-type]


def check_entry_source(text: str, path: Path, read_module: ModuleReader | None = None) -> list[Problem]:
    """Every finding of the Common Mistakes checks in the entry file's source ``text``.

    With ``read_module`` (see ``read_sibling_module``), an execute re-exported from another module of
    the tool (``export { execute } from './impl'``, ``export * from './impl'``) is checked there.
    """
    root = parse(text, path.name)
    found = _Findings(path)
    exports = find_exports(root)
    _check_exports(root, exports, path.name, found.add)
    _check_entry_points(root, exports, found.add)
    _check_bun(root, found.add)
    execute = execute_function(root, exports)
    if execute is None and read_module is not None:
        followed = follow_execute(path, root, exports, read_module)
        if followed is not None:
            found.where, execute = followed
    if execute is not None:
        _check_execute(execute, found.add)
    return sorted(found.problems, key=lambda p: (p.path != path, p.line or 0))


def _check_exports(root: Node, exports: Exports, name: str, add: Callable[..., None]) -> None:
    """execute-export, class-pattern, module-exports: how (and whether) execute is exported."""
    if exports.execute_at is None and not exports.unknown:
        for node, check, message, fix in exports.problems:
            add(node, check, message, fix)
        if exports.problems:
            return
        local = local_definition(root, "execute")
        if local is not None:
            add(local, "execute-export", f"execute is defined but not exported, so the loader cannot find it in {name}",
                "put 'export' in front of it: 'export async function execute(...)'")
        else:
            add(None, "execute-export", f"{name} does not export a function named execute, "
                "which is the only thing the loader calls", EXPORT_FIX)
    elif exports.commonjs is not None:
        add(exports.commonjs, "module-exports",
            f"{name} exports execute through {exports.commonjs_how}: sandboxd finds it there, but the tool format "
            "(docs/tools.md) asks for a named export, and pi's own loader does not find execute there",
            EXPORT_FIX, "warning")


def _check_entry_points(root: Node, exports: Exports, add: Callable[..., None]) -> None:
    """cli-entry-point: code that runs only as a script; an error when nothing else is exported."""
    severity = "warning" if exports.execute_at is not None or exports.unknown else "error"
    for node, snippet in _cli_entry_points(root):
        if snippet == "process.argv":
            message = ("reads process.argv at load time, like a command-line script: a tool never gets "
                       "command-line arguments (process.argv is the sandbox's own)")
        else:
            message = f"a CLI entry point ({snippet}): tools are loaded as modules, never run as a script, so this never runs"
        add(node, "cli-entry-point", message,
            "declare the values as inputs in TOOL.md and read them from execute's params; remove the "
            "command-line code", severity)


def _check_bun(root: Node, add: Callable[..., None]) -> None:
    """bun-api: Bun's globals, which Node.js has not (a warning behind a typeof Bun guard)."""
    guarded = any(n.type == "unary_expression" and node_text(n.child_by_field_name("operator")) == "typeof"
                  and node_text(n.child_by_field_name("argument")) == "Bun" for n in walk(root))
    for node, what in _bun_uses(root):
        add(node, "bun-api",
            f"{what}: tools run in Node.js, not Bun, where this throws ReferenceError or fails to load"
            + (" (unless the typeof Bun guard avoids it)" if guarded else ""),
            "use the Node.js standard library: fs.readFileSync/fs.writeFileSync for Bun.file/Bun.write, "
            "setTimeout for Bun.sleep, child_process.spawn/execFileSync for Bun.spawn",
            "warning" if guarded else "error")


def _check_execute(execute: Node, add: Callable[..., None]) -> None:
    """console-log, throw, no-return, implicit-return: what execute's body does."""
    for node, snippet in _prints_in(execute):
        add(node, "console-log",
            f"execute prints with {snippet}: the agent never sees printed output "
            "(it goes to the sandbox's log)",
            "return what the agent should read: 'return ok(text)' or { content: [{ type: 'text', text }] }; "
            "use onUpdate for progress and console.error for debugging logs", "warning")
    for node in _escaping_throws(execute):
        add(node, "throw",
            "a throw in execute outside any try block: the call fails and the agent reads only the error's "
            "message (from a bug, e.g. 'TypeError: Cannot read properties of undefined')",
            "return an error result that tells the agent what went wrong and what to do, e.g. "
            "'return err(\"...\")', or "
            "wrap execute's body in try/catch and return { content: [...], isError: true } from the catch",
            "warning")
    return_checks(execute, add)


def check_entry_file(path: Path) -> list[Problem]:
    """Read the entry file and check it; unreadable or oversized files are problems too."""
    try:
        data = path.read_bytes()[: MAX_SOURCE_BYTES + 1]
    except OSError as exc:
        return [Problem(path, f"cannot read {path.name}: {exc.strerror}", "make the file readable")]
    if len(data) > MAX_SOURCE_BYTES:
        return [Problem(path, f"{path.name} is over {MAX_SOURCE_BYTES} bytes, too big to check",
                        "split the code into smaller modules next to the entry file", severity="warning")]
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        return [Problem(path, f"{path.name} is not UTF-8 text (byte {exc.start})", "save the file as UTF-8", line=line)]
    return check_entry_source(text, path, functools.partial(read_sibling_module, path.parent))


def _inside_function(node: Node) -> bool:
    parent = node.parent
    while parent is not None:
        if parent.type in FUNCTIONS:
            return True
        parent = parent.parent
    return False


def _member_path(node: Node) -> str | None:
    """``console.log`` for a member chain on a free name; None for anything else (``a.console.log``, calls)."""
    parts: list[str] = []
    current: Node | None = node
    while current is not None and current.type == "member_expression":
        parts.append(node_text(current.child_by_field_name("property")))
        current = current.child_by_field_name("object")
    if current is None:
        return None
    node = current
    if node.type != "identifier":
        return None
    return ".".join([node_text(node), *reversed(parts)])


def _cli_entry_points(root: Node) -> list[tuple[Node, str]]:
    found = []
    for node in walk(root):
        if node.type == "binary_expression":
            operator = node_text(node.child_by_field_name("operator"))
            left, right = node.child_by_field_name("left"), node.child_by_field_name("right")
            if operator in ("===", "==", "!==", "!=") and left is not None and right is not None:
                sides = (_member_path(left), _member_path(right))
                if sides == ("require.main", "module") or sides == ("module", "require.main"):
                    found.append((node, f"{node_text(left)} {operator} {node_text(right)}"))
        elif node.type == "member_expression":
            target = node.child_by_field_name("object")
            prop = node_text(node.child_by_field_name("property"))
            if target is not None and target.type == "meta_property" and prop == "main":
                found.append((node, "import.meta.main"))
            elif _member_path(node) == "process.argv" and not _inside_function(node):
                found.append((node, "process.argv"))  # outside any function: a script's arguments
    return found


def _bun_uses(root: Node) -> list[tuple[Node, str]]:
    found = []
    for node in walk(root):
        if node.type in ("member_expression", "subscript_expression"):
            target = node.child_by_field_name("object")
            if target is not None and target.type == "identifier" and node_text(target) == "Bun":
                member = node_text(node.child_by_field_name("property")) if node.type == "member_expression" else ""
                found.append((node, f"uses the Bun API Bun.{member}" if member else "uses the Bun API"))
        elif node.type == "string":
            module = string_value(node)
            if not (module == "bun" or module.startswith("bun:")):
                continue
            parent = node.parent
            imported = parent is not None and (
                parent.type in ("import_statement", "export_statement")
                or (parent.type == "arguments" and parent.parent is not None
                    and parent.parent.type == "call_expression"
                    and node_text(parent.parent.child_by_field_name("function")) in ("require", "import")))
            if imported:
                found.append((node, f"imports the Bun module '{module}'"))
    return found


_PRINTS = ("console.log", "console.info", "process.stdout.write")


def _prints_in(execute: Node) -> list[tuple[Node, str]]:
    """console.log / console.info / process.stdout.write anywhere in execute's body."""
    found = []
    for node in walk(execute):
        if node.type == "call_expression":
            callee = node.child_by_field_name("function")
            printer = _member_path(callee) if callee is not None else None
            if printer in _PRINTS:
                found.append((node, printer))
    return found


def _escaping_throws(execute: Node) -> list[Node]:
    """throw statements of execute itself (not of functions inside it) that no try block encloses."""
    found: list[Node] = []
    body = execute.child_by_field_name("body")
    if body is None:
        return found
    for node in walk(body, into_functions=False):
        if node.type == "throw_statement" and not _in_try_block(node, execute):
            found.append(node)
    return found


def _in_try_block(node: Node, within: Node) -> bool:
    child, parent = node, node.parent
    while parent is not None and parent != within:
        if parent.type == "try_statement" and parent.child_by_field_name("body") == child:
            return True
        child, parent = parent, parent.parent
    return False
