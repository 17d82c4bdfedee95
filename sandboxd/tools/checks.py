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

import enum
import filecmp
import functools
import json
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import tree_sitter
import tree_sitter_typescript

from sandboxd.tools.discovery import ENTRY_FILES
from sandboxd.tools.manifest import MANIFEST_FILE, read_version
from sandboxd.tools.problem import Problem

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
_FUNCTIONS = frozenset({"function_declaration", "generator_function_declaration", "function_expression",
                        "function", "generator_function", "arrow_function", "method_definition"})
_CLASSES = frozenset({"class_declaration", "abstract_class_declaration", "class"})
_WRAPPERS = frozenset({"parenthesized_expression", "as_expression", "satisfies_expression", "non_null_expression"})


def _parse(text: str, name: str = "index.ts") -> Node:
    """The syntax tree's root; never raises (broken code gives ERROR nodes, which the checks pass over)."""
    data = text.encode("utf-8", errors="surrogatepass")  # lone surrogates: keep the byte offsets line-true
    language = _TSX if name.endswith((".tsx", ".jsx")) else _TS
    return tree_sitter.Parser(language).parse(data).root_node


def _text(node: Node | None) -> str:
    return node.text.decode("utf-8", errors="replace") if node is not None and node.text is not None else ""


def _line(node: Node) -> int:
    return node.start_point.row + 1


def _walk(node: Node, into_functions: bool = True) -> Iterator[Node]:
    """Every node under ``node`` (not ``node`` itself), in source order."""
    stack = list(reversed(node.children))
    while stack:
        current = stack.pop()
        yield current
        if into_functions or current.type not in _FUNCTIONS:
            stack.extend(reversed(current.children))


# --- exports ---------------------------------------------------------------------------------------


@dataclass
class _Exports:
    execute_at: Node | None = None  # where the execute export is written
    execute_value: Node | None = None  # its value (a function, or a name to look up) when it is in this file
    commonjs: Node | None = None  # module.exports / exports.x: runs in sandboxd, not in pi's own loader
    commonjs_how: str = ""
    unknown: bool = False  # export *, module.exports = require(...): execute may be exported unseen
    execute_from: tuple[str, str] | None = None  # export { run as execute } from './impl': ("./impl", "run")
    star_from: list[str] = field(default_factory=list)  # export * from './impl'
    problems: list[tuple[Node | None, str, str, str]] = field(default_factory=list)  # node, check id, message, fix


def _unwrap(node: Node | None) -> Node | None:
    while node is not None and node.type in _WRAPPERS:
        node = node.named_children[0] if node.named_children else None
    return node


def _top_level(root: Node) -> Iterator[Node]:
    """Top-level statements, with the declarations inside ``export`` statements."""
    for statement in root.named_children:
        yield statement
        declaration = statement.child_by_field_name("declaration") if statement.type == "export_statement" else None
        if declaration is not None:
            yield declaration


def _local_definition(root: Node, name: str, kinds: frozenset[str] | None = None) -> Node | None:
    """The top-level declaration of ``name``: a function, a class, or a variable's declarator."""
    for statement in _top_level(root):
        if statement.type in ("lexical_declaration", "variable_declaration"):
            if kinds is not None and "variable" not in kinds:
                continue
            for declarator in statement.named_children:
                if declarator.type == "variable_declarator" and _text(declarator.child_by_field_name("name")) == name:
                    return declarator
        elif statement.type in _FUNCTIONS | _CLASSES and (kinds is None or statement.type in kinds):
            if _text(statement.child_by_field_name("name")) == name:
                return statement
    return None


def _find_exports(root: Node) -> _Exports:
    out = _Exports()
    for statement in root.named_children:
        if statement.type == "export_statement":
            _export_statement(statement, out)
    for node in _walk(root):
        if node.type != "assignment_expression":
            continue
        left, right = node.child_by_field_name("left"), node.child_by_field_name("right")
        if _is_module_exports(left):
            _module_exports_value(node, right, out, "module.exports")
        elif _execute_property_of_exports(left):
            out.execute_at, out.execute_value = node, _unwrap(right)
            out.commonjs, out.commonjs_how = node, _text(left).split("[")[0].removesuffix(".execute") + ".execute"
    return out


def _is_module_exports(node: Node | None) -> bool:
    if node is None or node.type != "member_expression":
        return False
    obj = node.child_by_field_name("object")
    return (obj is not None and obj.type == "identifier" and _text(obj) == "module"
            and _text(node.child_by_field_name("property")) == "exports")


def _execute_property_of_exports(node: Node | None) -> bool:
    """``exports.execute``, ``module.exports.execute``, ``exports["execute"]``."""
    if node is None:
        return False
    target = node.child_by_field_name("object")
    if target is None or not ((target.type == "identifier" and _text(target) == "exports") or _is_module_exports(target)):
        return False
    if node.type == "member_expression":
        return _text(node.child_by_field_name("property")) == "execute"
    if node.type == "subscript_expression":
        index = node.child_by_field_name("index")
        return index is not None and index.type == "string" and _string_value(index) == "execute"
    return False


def _string_value(node: Node) -> str:
    return "".join(_text(c) for c in node.named_children if c.type in ("string_fragment", "escape_sequence"))


def _export_statement(statement: Node, out: _Exports) -> None:
    """One ``export ...`` statement: what it says of execute, by its form."""
    declaration = statement.child_by_field_name("declaration")
    source = statement.child_by_field_name("source")
    clause = next((c for c in statement.named_children if c.type == "export_clause"), None)
    if any(c.type == "default" for c in statement.children):
        _default_export(statement, declaration or statement.child_by_field_name("value"), out)
    elif declaration is not None:
        _export_declaration(statement, declaration, out)
    elif clause is not None:
        if not any(c.type == "type" for c in statement.children):  # export type { ... }: types only
            _export_clause(statement, clause, source, out)
    elif source is not None:
        # export * from './impl' may carry execute; export * as ns from does not
        if not any(c.type == "namespace_export" for c in statement.named_children):
            out.unknown = True
            out.star_from.append(_string_value(source))
    elif any(c.type == "=" for c in statement.children) and statement.named_children:  # TypeScript's "export = value"
        _module_exports_value(statement, statement.named_children[-1], out, "export =")


def _export_declaration(statement: Node, declaration: Node, out: _Exports) -> None:
    """``export function execute``, ``export const execute = ...``, ``export declare ...``, ``export class``."""
    kind = declaration.type
    if kind == "ambient_declaration":  # export declare function execute(): ...
        inner = declaration.named_children[0] if declaration.named_children else None
        if inner is not None and _text(inner.child_by_field_name("name")) == "execute":
            out.execute_at = statement
    elif kind in ("function_declaration", "generator_function_declaration"):
        if _text(declaration.child_by_field_name("name")) == "execute":
            out.execute_at, out.execute_value = statement, declaration
    elif kind in ("lexical_declaration", "variable_declaration"):
        for declarator in declaration.named_children:
            if declarator.type == "variable_declarator" and _text(declarator.child_by_field_name("name")) == "execute":
                out.execute_at, out.execute_value = statement, _unwrap(declarator.child_by_field_name("value"))
    elif kind in _CLASSES:
        class_name = _text(declaration.child_by_field_name("name")) or "a class"
        out.problems.append((statement, "class-pattern",
                             f"exports class {class_name} but no execute function: class-based tools are not "
                             "supported, the loader calls a function named execute",
                             f"export a function named execute that does the work (it may use the class): "
                             f"{EXECUTE_SIGNATURE}"))


def _export_clause(statement: Node, clause: Node, source: Node | None, out: _Exports) -> None:
    """``export { run as execute }``, or ``... from './impl'``."""
    for specifier in clause.named_children:
        if specifier.type != "export_specifier" or any(c.type == "type" for c in specifier.children):
            continue
        local = specifier.child_by_field_name("name")
        if _name_of(specifier.child_by_field_name("alias") or local) != "execute":
            continue
        out.execute_at = statement
        out.execute_value = None if source is not None else local
        if source is not None:
            out.execute_from = (_string_value(source), _name_of(local))


def _name_of(node: Node | None) -> str:
    if node is None:
        return ""
    return _string_value(node) if node.type == "string" else _text(node)


def _default_export(statement: Node, value: Node | None, out: _Exports) -> None:
    value = _unwrap(value)
    if value is not None and value.type in _CLASSES:
        message = "exports a class as default but no execute function: class-based tools are not supported"
        out.problems.append((statement, "class-pattern", message, EXPORT_FIX))
        return
    if value is not None and value.type == "object" and _object_key(value, "execute") is not None:
        message = "execute is a property of the default export, but the loader looks for an export named execute"
    elif value is not None and value.type in _FUNCTIONS and _text(value.child_by_field_name("name")) == "execute":
        message = "execute is the default export, but the loader looks for an export named execute"
    else:
        message = "there is a default export but no export named execute, the function the loader calls"
    out.problems.append((statement, "execute-export", message, EXPORT_FIX))


def _module_exports_value(at: Node, value: Node | None, out: _Exports, how: str) -> None:
    """``module.exports = value`` (or ``export = value``): execute when the value is an object with it."""
    value = _unwrap(value)
    if value is None:
        return
    if value.type == "object":
        key = _object_key(value, "execute")
        if key is None and any(c.type == "spread_element" for c in value.named_children):
            out.unknown = True  # execute may come from the spread
            out.commonjs, out.commonjs_how = at, how
        elif key is not None:
            out.execute_at, out.execute_value = at, key
            out.commonjs, out.commonjs_how = at, how
        else:
            out.problems.append((at, "module-exports", f"{how} is set to an object without execute",
                                 "add execute to it, or better: " + EXPORT_FIX))
        return
    if value.type in _CLASSES:
        out.problems.append((at, "class-pattern", f"{how} is set to a class: class-based tools are not supported",
                             EXPORT_FIX))
        return
    if value.type in _FUNCTIONS:
        out.problems.append((at, "module-exports", f"{how} is set to a function, so there is no execute export",
                             f"export the function by name: {EXECUTE_SIGNATURE}"))
        return
    if value.type == "identifier":
        root = at
        while root.parent is not None:
            root = root.parent
        declared = _local_definition(root, _text(value))
        if declared is not None and declared.type in _CLASSES:
            out.problems.append((at, "class-pattern",
                                 f"{how} is set to the class {_text(value)}: class-based tools are not supported",
                                 EXPORT_FIX))
            return
        defined = _unwrap(declared.child_by_field_name("value")) if declared is not None \
            and declared.type == "variable_declarator" else declared
        if defined is not None and defined.type in _FUNCTIONS:
            # What the shim then says at every call: "sets module.exports to a function (...), so there is
            # no execute export". The loader looks for a property named execute, not at the function.
            function = _text(value)
            exported = "{ execute }" if function == "execute" else f"{{ execute: {function} }}"
            out.problems.append((at, "module-exports",
                                 f"{how} is set to the function {function}, so there is no execute export "
                                 "and every call fails",
                                 f"export it by name instead: 'export async function execute(...)' "
                                 f"(or at least '{how} = {exported}')"))
            return
    out.unknown = True  # require(...), a variable, new X(): cannot tell from here
    out.commonjs, out.commonjs_how = at, how


def _object_key(obj: Node, key: str) -> Node | None:
    """The value of ``key`` in an object literal: a pair's value, a method, or a shorthand name."""
    for member in obj.named_children:
        if member.type == "pair" and _name_of(member.child_by_field_name("key")) == key:
            return _unwrap(member.child_by_field_name("value"))
        if member.type == "method_definition" and _name_of(member.child_by_field_name("name")) == key:
            return member
        if member.type == "shorthand_property_identifier" and _text(member) == key:
            return member
    return None


def _execute_function(root: Node, exports: _Exports) -> Node | None:
    """The exported execute's function node, when it is defined in this file."""
    value = exports.execute_value
    for _ in range(4):  # follow a few name-to-definition hops (export { run as execute }, { execute })
        if value is None or value.type in _FUNCTIONS:
            return value
        if value.type not in ("identifier", "shorthand_property_identifier"):
            return None  # built by a call or taken from elsewhere: cannot tell
        definition = _local_definition(root, _text(value))
        if definition is None:
            return None
        value = _unwrap(definition.child_by_field_name("value")) if definition.type == "variable_declarator" \
            else definition
    return None


def _imported_from(root: Node, local: str) -> tuple[str, str] | None:
    """``import { name as local } from 'spec'`` → ("spec", "name"); None when ``local`` is not imported so."""
    for statement in root.named_children:
        if statement.type != "import_statement" or statement.child_by_field_name("source") is None:
            continue
        for node in _walk(statement):
            if node.type == "import_specifier":
                name = node.child_by_field_name("name")
                alias = node.child_by_field_name("alias") or name
                source = statement.child_by_field_name("source")
                if _name_of(alias) == local and source is not None:
                    return _string_value(source), _name_of(name)
    return None


class _Missing(enum.Enum):
    HERE = "not exported by this statement"


def _exported_function(root: Node, name: str) -> Node | tuple[str, str] | None:
    """What a module exports as ``name``: its function, ("spec", "name") when it comes from another module,
    or None when this cannot tell."""
    for statement in root.named_children:
        if statement.type != "export_statement" or any(c.type == "default" for c in statement.children):
            continue
        declaration = statement.child_by_field_name("declaration")
        found = (_declared_function(declaration, name) if declaration is not None
                 else _re_exported_function(root, statement, name))
        if found is not _Missing.HERE:
            return found
    return None


def _declared_function(declaration: Node, name: str) -> Node | None | _Missing:
    """``export function name`` or ``export const name = ...``: its function (None: not a function)."""
    if declaration.type in _FUNCTIONS and _text(declaration.child_by_field_name("name")) == name:
        return declaration
    if declaration.type in ("lexical_declaration", "variable_declaration"):
        for declarator in declaration.named_children:
            if _text(declarator.child_by_field_name("name")) == name:
                value = _unwrap(declarator.child_by_field_name("value"))
                return value if value is not None and value.type in _FUNCTIONS else None
    return _Missing.HERE


def _re_exported_function(root: Node, statement: Node, name: str) -> Node | tuple[str, str] | None | _Missing:
    """``export { local as name }`` (from this module, an import, or ``from 'spec'``)."""
    clause = next((c for c in statement.named_children if c.type == "export_clause"), None)
    source = statement.child_by_field_name("source")
    for specifier in clause.named_children if clause is not None else []:
        local = specifier.child_by_field_name("name")
        if _name_of(specifier.child_by_field_name("alias") or local) != name:
            continue
        if source is not None:
            return _string_value(source), _name_of(local)
        found = _execute_function(root, _Exports(execute_value=local))
        return found if found is not None else _imported_from(root, _name_of(local))
    return _Missing.HERE


ModuleReader = Callable[[Path, str], "tuple[Path, str] | None"]
MAX_FOLLOWED_MODULES = 4  # re-export hops followed from the entry file


def _follow_execute(path: Path, root: Node, exports: _Exports, read_module: ModuleReader
                    ) -> tuple[Path, Node] | None:
    """The execute that the entry re-exports from a module next to it: that file and the function."""
    targets: list[tuple[str, str]] = []
    if exports.execute_from is not None:
        targets.append(exports.execute_from)
    elif exports.execute_value is not None and exports.execute_value.type == "identifier":
        imported = _imported_from(root, _text(exports.execute_value))  # import { run } ...; export { run as execute }
        if imported is not None:
            targets.append(imported)
    elif exports.execute_at is None:
        targets.extend((spec, "execute") for spec in exports.star_from)
    seen: set[Path] = set()
    for spec, name in targets:
        current = path
        for _ in range(MAX_FOLLOWED_MODULES):
            module = read_module(current, spec)
            if module is None or module[0] in seen:
                break
            current, text = module
            seen.add(current)
            found = _exported_function(_parse(text, current.name), name)
            if isinstance(found, tuple):
                spec, name = found
                continue
            if found is not None:
                return current, found
            break
    return None


_MODULE_SUFFIXES = (".ts", ".tsx", ".mts", ".cts", ".js", ".mjs", ".cjs", ".jsx")


def read_sibling_module(root: Path, importer: Path, spec: str) -> tuple[Path, str] | None:
    """The file a relative import names, when it lies inside the tool's folder ``root`` (the sandbox mounts
    only that folder, so a module outside it would not load there either)."""
    if not spec.startswith(("./", "../")):
        return None  # a package or a node: builtin: not the tool's code
    base = importer.parent / spec
    names = [base] if base.suffix in _MODULE_SUFFIXES else []
    if base.suffix in (".js", ".mjs", ".cjs"):  # TypeScript's ESM convention: './impl.js' is impl.ts
        names.append(base.with_suffix(base.suffix.replace("j", "t")))
    names += [base.with_name(base.name + suffix) for suffix in _MODULE_SUFFIXES]
    names += [base / f"index{suffix}" for suffix in _MODULE_SUFFIXES]
    for candidate in names:
        if candidate.is_file() and candidate.resolve().is_relative_to(root.resolve()):
            try:
                data = candidate.read_bytes()[: MAX_SOURCE_BYTES + 1]
                if len(data) > MAX_SOURCE_BYTES:
                    return None
                return candidate, data.decode("utf-8")
            except (OSError, UnicodeDecodeError):
                return None
    return None


# --- the checks ------------------------------------------------------------------------------------


@dataclass
class _Findings:
    """The problems found so far; ``where`` is the file execute's findings are in: the entry, or the
    module it re-exports execute from."""

    where: Path
    problems: list[Problem] = field(default_factory=list)

    def add(self, node: Node | None, check: str, message: str, fix: str, severity: str = "error",
            line: int | None = None) -> None:
        line = line if line is not None else _line(node) if node is not None else 1  # None: the whole file
        self.problems.append(Problem(self.where, message, fix, field=check, line=line,
                                     severity=severity))  # type: ignore[arg-type]


def check_entry_source(text: str, path: Path, read_module: ModuleReader | None = None) -> list[Problem]:
    """Every finding of the Common Mistakes checks in the entry file's source ``text``.

    With ``read_module`` (see ``read_sibling_module``), an execute re-exported from another module of
    the tool (``export { execute } from './impl'``, ``export * from './impl'``) is checked there.
    """
    root = _parse(text, path.name)
    found = _Findings(path)
    exports = _find_exports(root)
    _check_exports(root, exports, path.name, found.add)
    _check_entry_points(root, exports, found.add)
    _check_bun(root, found.add)
    execute = _execute_function(root, exports)
    if execute is None and read_module is not None:
        followed = _follow_execute(path, root, exports, read_module)
        if followed is not None:
            found.where, execute = followed
    if execute is not None:
        _check_execute(execute, found.add)
    return sorted(found.problems, key=lambda p: (p.path != path, p.line or 0))


def _check_exports(root: Node, exports: _Exports, name: str, add: Callable[..., None]) -> None:
    """execute-export, class-pattern, module-exports: how (and whether) execute is exported."""
    if exports.execute_at is None and not exports.unknown:
        for node, check, message, fix in exports.problems:
            add(node, check, message, fix)
        if exports.problems:
            return
        local = _local_definition(root, "execute")
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


def _check_entry_points(root: Node, exports: _Exports, add: Callable[..., None]) -> None:
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
    guarded = any(n.type == "unary_expression" and _text(n.child_by_field_name("operator")) == "typeof"
                  and _text(n.child_by_field_name("argument")) == "Bun" for n in _walk(root))
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
    _return_checks(execute, add)


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
        if parent.type in _FUNCTIONS:
            return True
        parent = parent.parent
    return False


def _member_path(node: Node) -> str | None:
    """``console.log`` for a member chain on a free name; None for anything else (``a.console.log``, calls)."""
    parts: list[str] = []
    current: Node | None = node
    while current is not None and current.type == "member_expression":
        parts.append(_text(current.child_by_field_name("property")))
        current = current.child_by_field_name("object")
    if current is None:
        return None
    node = current
    if node.type != "identifier":
        return None
    return ".".join([_text(node), *reversed(parts)])


def _cli_entry_points(root: Node) -> list[tuple[Node, str]]:
    found = []
    for node in _walk(root):
        if node.type == "binary_expression":
            operator = _text(node.child_by_field_name("operator"))
            left, right = node.child_by_field_name("left"), node.child_by_field_name("right")
            if operator in ("===", "==", "!==", "!=") and left is not None and right is not None:
                sides = (_member_path(left), _member_path(right))
                if sides == ("require.main", "module") or sides == ("module", "require.main"):
                    found.append((node, f"{_text(left)} {operator} {_text(right)}"))
        elif node.type == "member_expression":
            target = node.child_by_field_name("object")
            prop = _text(node.child_by_field_name("property"))
            if target is not None and target.type == "meta_property" and prop == "main":
                found.append((node, "import.meta.main"))
            elif _member_path(node) == "process.argv" and not _inside_function(node):
                found.append((node, "process.argv"))  # outside any function: a script's arguments
    return found


def _bun_uses(root: Node) -> list[tuple[Node, str]]:
    found = []
    for node in _walk(root):
        if node.type in ("member_expression", "subscript_expression"):
            target = node.child_by_field_name("object")
            if target is not None and target.type == "identifier" and _text(target) == "Bun":
                member = _text(node.child_by_field_name("property")) if node.type == "member_expression" else ""
                found.append((node, f"uses the Bun API Bun.{member}" if member else "uses the Bun API"))
        elif node.type == "string":
            module = _string_value(node)
            if not (module == "bun" or module.startswith("bun:")):
                continue
            parent = node.parent
            imported = parent is not None and (
                parent.type in ("import_statement", "export_statement")
                or (parent.type == "arguments" and parent.parent is not None
                    and parent.parent.type == "call_expression"
                    and _text(parent.parent.child_by_field_name("function")) in ("require", "import")))
            if imported:
                found.append((node, f"imports the Bun module '{module}'"))
    return found


_PRINTS = ("console.log", "console.info", "process.stdout.write")


def _prints_in(execute: Node) -> list[tuple[Node, str]]:
    """console.log / console.info / process.stdout.write anywhere in execute's body."""
    found = []
    for node in _walk(execute):
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
    for node in _walk(body, into_functions=False):
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


# --- returns ---------------------------------------------------------------------------------------


def _return_checks(execute: Node, add: Callable[..., None]) -> None:
    """An execute that never returns a value is an error, and so is one with a path that ends without
    a return (TypeScript's noImplicitReturns). An end that cannot be reached (every path returns or
    throws) is fine."""
    body = execute.child_by_field_name("body")
    if body is None or body.type != "statement_block":
        return  # an arrow's expression body is its return value
    if not body.named_children or all(c.type == "comment" for c in body.named_children):
        return  # an empty body is a placeholder (docs/tools.md's own "// Implementation here")
    try:
        completes = _completes(body)
    except RecursionError:  # nesting deeper than Python's stack: say nothing rather than guess
        return
    if not completes:
        return
    returns_value = any(n.type == "return_statement" and len(n.named_children) > 0
                        for n in _walk(body, into_functions=False))
    end_line = body.end_point.row + 1
    if not returns_value:
        add(execute, "no-return",
            "execute never returns a ToolResult: it ends without a return, so the agent gets "
            "'execute returned undefined' instead of an answer",
            f"end execute with a return of its result: '{RETURN_FIX}' (or 'return ok(text)')", "error")
    else:
        # An error, not a style point: every call that takes that path fails (often the success path,
        # when the error branches are the ones that return).
        add(execute, "implicit-return",
            "a path through execute reaches its end without a return (TypeScript's noImplicitReturns): every "
            "call that takes it fails with 'execute returned undefined'",
            f"return a result at the end of that path too, e.g. 'return ok(text)' or '{RETURN_FIX}'",
            "error", line=end_line)


def _completes(node: Node) -> bool:
    """Whether running the statement can reach its end (not every path returns or throws)."""
    kind = node.type
    if kind in ("return_statement", "throw_statement"):
        return False
    if kind == "statement_block":
        return _sequence_completes(node.named_children)
    judge = _COMPLETES_BY_KIND.get(kind)
    # A labeled statement, an expression, a declaration...: a labeled break may leave it, so assume it can end.
    return judge(node) if judge is not None else True


def _if_completes(node: Node) -> bool:
    alternative = node.child_by_field_name("alternative")
    if alternative is None:
        return True
    consequence = node.child_by_field_name("consequence")
    other = alternative.named_children[0] if alternative.named_children else None
    return consequence is None or other is None or _completes(consequence) or _completes(other)


def _try_completes(node: Node) -> bool:
    finalizer = node.child_by_field_name("finalizer")
    final_body = finalizer.child_by_field_name("body") if finalizer is not None else None
    if final_body is not None and not _completes(final_body):
        return False
    body = node.child_by_field_name("body")
    handler = node.child_by_field_name("handler")
    handler_body = handler.child_by_field_name("body") if handler is not None else None
    return (body is None or _completes(body)) or (handler_body is not None and _completes(handler_body))


def _switch_completes(node: Node) -> bool:
    body = node.child_by_field_name("body")
    clauses = [c for c in body.named_children if c.type in ("switch_case", "switch_default")] if body else []
    if not any(c.type == "switch_default" for c in clauses) or _breaks_out(node):
        return True
    # Cases fall through, so only the last one's end decides.
    last = clauses[-1]
    value = last.child_by_field_name("value")
    return _sequence_completes([c for c in last.named_children if c != value and c.type != "comment"])


def _loop_completes(node: Node) -> bool:
    condition = node.child_by_field_name("condition")
    endless = condition is None or _text(condition).strip("(); ") in ("true", "")
    return not endless or _breaks_out(node)


_COMPLETES_BY_KIND: dict[str, Callable[[Node], bool]] = {
    "if_statement": _if_completes, "try_statement": _try_completes, "switch_statement": _switch_completes,
    "while_statement": _loop_completes, "for_statement": _loop_completes, "do_statement": _loop_completes,
}


def _sequence_completes(statements: list[Node]) -> bool:
    return all(_completes(s) for s in statements if s.type != "comment")


def _breaks_out(loop: Node) -> bool:
    """Whether a break inside ``loop`` (not in a nested loop, switch or function) leaves it."""
    nested = _FUNCTIONS | {"while_statement", "for_statement", "for_in_statement", "do_statement", "switch_statement"}
    stack = list(loop.named_children)
    while stack:
        node = stack.pop()
        if node.type == "break_statement":
            return True
        if node.type not in nested:
            stack.extend(node.named_children)
    return False


# --- the synced copy ---------------------------------------------------------------------------

MAX_COMPARED_FILES = 2000  # beyond this, only TOOL.md and the entry files are compared


def check_synced_copy(tool_dir: Path, data_path: Path) -> list[Problem]:
    """"Bump version": the tool differs from its synced copy in DATA_PATH/tools, which sync will keep.

    Sync copies a seed tool only when its version is higher than the installed
    one's (docs/tools.md, "Sync"), so an edit without a bump never arrives.
    Tools inside DATA_PATH (the synced copies themselves, users' own tools) are
    not synced and not checked.
    """
    data_path = Path(data_path).resolve()
    real_dir = Path(tool_dir).resolve()
    installed = data_path / "tools" / real_dir.name
    if real_dir.is_relative_to(data_path) or not installed.is_dir():
        return []
    manifest = real_dir / MANIFEST_FILE
    version, installed_version = read_version(manifest), read_version(installed / MANIFEST_FILE)
    if version > installed_version or _same_tree(real_dir, installed):
        return []
    line = _version_line(manifest)
    if version == installed_version:
        message = (f"this tool differs from its synced copy in {installed} but has the same version {version}, "
                   "so sync keeps the old copy and the agent never sees the change")
    else:
        message = (f"the synced copy in {installed} has version {installed_version}, higher than this tool's "
                   f"{version}, so sync never replaces it")
    return [Problem(tool_dir / MANIFEST_FILE, message, f"bump the version: 'version: {installed_version + 1}'",
                    field="version", line=line)]


def _version_line(manifest: Path) -> int | None:
    try:
        lines = manifest.read_text(encoding="utf-8-sig", errors="replace").splitlines()
    except OSError:
        return None
    return next((n for n, text in enumerate(lines[1:], start=2) if re.match(r"version\s*:", text)), None)


def _tree(root: Path) -> dict[str, Path] | None:
    """Relative path → path of every file and link under ``root``; None when there are too many."""
    found: dict[str, Path] = {}
    for directory, dirs, files in os.walk(root):
        base = Path(directory)
        for name in files + [d for d in dirs if (base / d).is_symlink()]:
            found[str((base / name).relative_to(root))] = base / name
            if len(found) > MAX_COMPARED_FILES:
                return None
    return found


def _same_tree(left: Path, right: Path) -> bool:
    left_files, right_files = _tree(left), _tree(right)
    if left_files is None or right_files is None:
        names = (MANIFEST_FILE, *ENTRY_FILES)
        left_files = {n: left / n for n in names if os.path.lexists(left / n)}
        right_files = {n: right / n for n in names if os.path.lexists(right / n)}
    if left_files.keys() != right_files.keys():
        return False
    for name, path in left_files.items():
        other = right_files[name]
        if path.is_symlink() or other.is_symlink():
            if not (path.is_symlink() and other.is_symlink() and os.readlink(path) == os.readlink(other)):
                return False
        elif not filecmp.cmp(path, other, shallow=False):
            return False
    return True
