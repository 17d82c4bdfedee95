"""Finding a tool's execute: what the entry file exports (ES modules, CommonJS, TypeScript's
``export =``), followed through re-exports into the tool's other modules where it must be."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from sandboxd.dev.lint.syntax import (
    CLASSES,
    EXECUTE_SIGNATURE,
    EXPORT_FIX,
    FUNCTIONS,
    MAX_SOURCE_BYTES,
    Node,
    local_definition,
    name_of,
    node_text,
    parse,
    string_value,
    unwrap,
    walk,
)


@dataclass
class Exports:
    execute_at: Node | None = None  # where the execute export is written
    execute_value: Node | None = None  # its value (a function, or a name to look up) when it is in this file
    commonjs: Node | None = None  # module.exports / exports.x: runs in sandboxd, not in pi's own loader
    commonjs_how: str = ""
    unknown: bool = False  # export *, module.exports = require(...): execute may be exported unseen
    execute_from: tuple[str, str] | None = None  # export { run as execute } from './impl': ("./impl", "run")
    star_from: list[str] = field(default_factory=list)  # export * from './impl'
    problems: list[tuple[Node | None, str, str, str]] = field(default_factory=list)  # node, check id, message, fix


def find_exports(root: Node) -> Exports:
    out = Exports()
    for statement in root.named_children:
        if statement.type == "export_statement":
            _export_statement(statement, out)
    for node in walk(root):
        if node.type != "assignment_expression":
            continue
        left, right = node.child_by_field_name("left"), node.child_by_field_name("right")
        if _is_module_exports(left):
            _module_exports_value(node, right, out, "module.exports")
        elif _execute_property_of_exports(left):
            out.execute_at, out.execute_value = node, unwrap(right)
            out.commonjs, out.commonjs_how = node, node_text(left).split("[")[0].removesuffix(".execute") + ".execute"
    return out


def _is_module_exports(node: Node | None) -> bool:
    if node is None or node.type != "member_expression":
        return False
    obj = node.child_by_field_name("object")
    return (obj is not None and obj.type == "identifier" and node_text(obj) == "module"
            and node_text(node.child_by_field_name("property")) == "exports")


def _execute_property_of_exports(node: Node | None) -> bool:
    """``exports.execute``, ``module.exports.execute``, ``exports["execute"]``."""
    if node is None:
        return False
    target = node.child_by_field_name("object")
    if target is None or not ((target.type == "identifier" and node_text(target) == "exports") or _is_module_exports(target)):
        return False
    if node.type == "member_expression":
        return node_text(node.child_by_field_name("property")) == "execute"
    if node.type == "subscript_expression":
        index = node.child_by_field_name("index")
        return index is not None and index.type == "string" and string_value(index) == "execute"
    return False


def _export_statement(statement: Node, out: Exports) -> None:
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
            out.star_from.append(string_value(source))
    elif any(c.type == "=" for c in statement.children) and statement.named_children:  # TypeScript's "export = value"
        _module_exports_value(statement, statement.named_children[-1], out, "export =")


def _export_declaration(statement: Node, declaration: Node, out: Exports) -> None:
    """``export function execute``, ``export const execute = ...``, ``export declare ...``, ``export class``."""
    kind = declaration.type
    if kind == "ambient_declaration":  # export declare function execute(): ...
        inner = declaration.named_children[0] if declaration.named_children else None
        if inner is not None and node_text(inner.child_by_field_name("name")) == "execute":
            out.execute_at = statement
    elif kind in ("function_declaration", "generator_function_declaration"):
        if node_text(declaration.child_by_field_name("name")) == "execute":
            out.execute_at, out.execute_value = statement, declaration
    elif kind in ("lexical_declaration", "variable_declaration"):
        for declarator in declaration.named_children:
            if declarator.type == "variable_declarator" and node_text(declarator.child_by_field_name("name")) == "execute":
                out.execute_at, out.execute_value = statement, unwrap(declarator.child_by_field_name("value"))
    elif kind in CLASSES:
        class_name = node_text(declaration.child_by_field_name("name")) or "a class"
        out.problems.append((statement, "class-pattern",
                             f"exports class {class_name} but no execute function: class-based tools are not "
                             "supported, the loader calls a function named execute",
                             f"export a function named execute that does the work (it may use the class): "
                             f"{EXECUTE_SIGNATURE}"))


def _export_clause(statement: Node, clause: Node, source: Node | None, out: Exports) -> None:
    """``export { run as execute }``, or ``... from './impl'``."""
    for specifier in clause.named_children:
        if specifier.type != "export_specifier" or any(c.type == "type" for c in specifier.children):
            continue
        local = specifier.child_by_field_name("name")
        if name_of(specifier.child_by_field_name("alias") or local) != "execute":
            continue
        out.execute_at = statement
        out.execute_value = None if source is not None else local
        if source is not None:
            out.execute_from = (string_value(source), name_of(local))


def _default_export(statement: Node, value: Node | None, out: Exports) -> None:
    value = unwrap(value)
    if value is not None and value.type in CLASSES:
        message = "exports a class as default but no execute function: class-based tools are not supported"
        out.problems.append((statement, "class-pattern", message, EXPORT_FIX))
        return
    if value is not None and value.type == "object" and _object_key(value, "execute") is not None:
        message = "execute is a property of the default export, but the loader looks for an export named execute"
    elif value is not None and value.type in FUNCTIONS and node_text(value.child_by_field_name("name")) == "execute":
        message = "execute is the default export, but the loader looks for an export named execute"
    else:
        message = "there is a default export but no export named execute, the function the loader calls"
    out.problems.append((statement, "execute-export", message, EXPORT_FIX))


def _module_exports_value(at: Node, value: Node | None, out: Exports, how: str) -> None:
    """``module.exports = value`` (or ``export = value``): execute when the value is an object with it."""
    value = unwrap(value)
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
    if value.type in CLASSES:
        out.problems.append((at, "class-pattern", f"{how} is set to a class: class-based tools are not supported",
                             EXPORT_FIX))
        return
    if value.type in FUNCTIONS:
        out.problems.append((at, "module-exports", f"{how} is set to a function, so there is no execute export",
                             f"export the function by name: {EXECUTE_SIGNATURE}"))
        return
    if value.type == "identifier":
        root = at
        while root.parent is not None:
            root = root.parent
        declared = local_definition(root, node_text(value))
        if declared is not None and declared.type in CLASSES:
            out.problems.append((at, "class-pattern",
                                 f"{how} is set to the class {node_text(value)}: class-based tools are not supported",
                                 EXPORT_FIX))
            return
        defined = unwrap(declared.child_by_field_name("value")) if declared is not None \
            and declared.type == "variable_declarator" else declared
        if defined is not None and defined.type in FUNCTIONS:
            # What the shim then says at every call: "sets module.exports to a function (...), so there is
            # no execute export". The loader looks for a property named execute, not at the function.
            function = node_text(value)
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
        if member.type == "pair" and name_of(member.child_by_field_name("key")) == key:
            return unwrap(member.child_by_field_name("value"))
        if member.type == "method_definition" and name_of(member.child_by_field_name("name")) == key:
            return member
        if member.type == "shorthand_property_identifier" and node_text(member) == key:
            return member
    return None


def execute_function(root: Node, exports: Exports) -> Node | None:
    """The exported execute's function node, when it is defined in this file."""
    value = exports.execute_value
    for _ in range(4):  # follow a few name-to-definition hops (export { run as execute }, { execute })
        if value is None or value.type in FUNCTIONS:
            return value
        if value.type not in ("identifier", "shorthand_property_identifier"):
            return None  # built by a call or taken from elsewhere: cannot tell
        definition = local_definition(root, node_text(value))
        if definition is None:
            return None
        value = unwrap(definition.child_by_field_name("value")) if definition.type == "variable_declarator" \
            else definition
    return None


def _imported_from(root: Node, local: str) -> tuple[str, str] | None:
    """``import { name as local } from 'spec'`` → ("spec", "name"); None when ``local`` is not imported so."""
    for statement in root.named_children:
        if statement.type != "import_statement" or statement.child_by_field_name("source") is None:
            continue
        for node in walk(statement):
            if node.type == "import_specifier":
                name = node.child_by_field_name("name")
                alias = node.child_by_field_name("alias") or name
                source = statement.child_by_field_name("source")
                if name_of(alias) == local and source is not None:
                    return string_value(source), name_of(name)
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
    if declaration.type in FUNCTIONS and node_text(declaration.child_by_field_name("name")) == name:
        return declaration
    if declaration.type in ("lexical_declaration", "variable_declaration"):
        for declarator in declaration.named_children:
            if node_text(declarator.child_by_field_name("name")) == name:
                value = unwrap(declarator.child_by_field_name("value"))
                return value if value is not None and value.type in FUNCTIONS else None
    return _Missing.HERE


def _re_exported_function(root: Node, statement: Node, name: str) -> Node | tuple[str, str] | None | _Missing:
    """``export { local as name }`` (from this module, an import, or ``from 'spec'``)."""
    clause = next((c for c in statement.named_children if c.type == "export_clause"), None)
    source = statement.child_by_field_name("source")
    for specifier in clause.named_children if clause is not None else []:
        local = specifier.child_by_field_name("name")
        if name_of(specifier.child_by_field_name("alias") or local) != name:
            continue
        if source is not None:
            return string_value(source), name_of(local)
        found = execute_function(root, Exports(execute_value=local))
        return found if found is not None else _imported_from(root, name_of(local))
    return _Missing.HERE


ModuleReader = Callable[[Path, str], "tuple[Path, str] | None"]
MAX_FOLLOWED_MODULES = 4  # re-export hops followed from the entry file


def follow_execute(path: Path, root: Node, exports: Exports, read_module: ModuleReader
                    ) -> tuple[Path, Node] | None:
    """The execute that the entry re-exports from a module next to it: that file and the function."""
    targets: list[tuple[str, str]] = []
    if exports.execute_from is not None:
        targets.append(exports.execute_from)
    elif exports.execute_value is not None and exports.execute_value.type == "identifier":
        imported = _imported_from(root, node_text(exports.execute_value))  # import { run } ...; export { run as execute }
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
            found = _exported_function(parse(text, current.name), name)
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
