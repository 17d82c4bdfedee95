"""Checking a TOOL.md's content: every problem found at once, each naming the file, the line,
the field and the fix; a manifest with any error is not returned."""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import re
from pathlib import Path
from typing import Any, cast

import yaml

from sandboxd.tools.manifest.model import (
    INPUT_KEYS,
    INPUT_TYPES,
    LANGUAGES,
    MAX_FRONTMATTER_BYTES,
    MAX_NAME_LENGTH,
    NO_DEFAULT,
    TOP_LEVEL_KEYS,
    Input,
    InputType,
    Manifest,
)
from sandboxd.tools.manifest.source import FENCE_RE, normalise, read_manifest_file, split_frontmatter
from sandboxd.tools.permissions import UNDECLARED, parse_permissions
from sandboxd.tools.problem import Problem, Severity
from sandboxd.tools.yaml12 import ManifestLoader, ParseTimeout, Refused

_NAME_RE = re.compile(r"[a-z][a-z0-9_]*")  # used with fullmatch: "$" would let a trailing newline through
_IDENTIFIER_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_TYPE_HINTS = {"integer": "number", "int": "number", "float": "number", "bool": "boolean", "str": "string"}


def parse_manifest(path: Path, *, within: Path | None = None) -> tuple[Manifest | None, list[Problem]]:
    """Parse the TOOL.md at ``path``. With ``within``, a file that resolves outside it is refused."""
    text, problem = read_manifest_file(Path(path), within)
    if problem is not None:
        return None, [problem]
    return parse_manifest_text(text, Path(path))


def _key_lines(node: yaml.Node | None, first_line: int) -> dict[str, int]:
    """File line of each key, as dotted paths ("inputs.mode.values"), for pointing at problems."""
    lines: dict[str, int] = {}

    def walk(node: yaml.Node, prefix: str, depth: int) -> None:
        if not isinstance(node, yaml.MappingNode) or depth > 3:
            return
        for key_node, value_node in node.value:
            if isinstance(key_node, yaml.ScalarNode):
                dotted = prefix + key_node.value
                lines.setdefault(dotted, first_line + key_node.start_mark.line)
                walk(value_node, dotted + ".", depth + 1)

    if node is not None:
        walk(node, "", 1)
    return lines


def parse_manifest_text(text: str, path: Path) -> tuple[Manifest | None, list[Problem]]:
    """Parse TOOL.md content; ``path`` names the file in problems."""
    return _ManifestChecker(Path(path)).check(text)


class _ManifestChecker:
    """Collects every problem of one manifest while building it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.problems: list[Problem] = []
        self.lines: dict[str, int] = {}

    def error(self, field: str | None, message: str, fix: str, line: int | None = None) -> None:
        self._add(field, message, fix, line or self._line(field), "error")

    def warning(self, field: str | None, message: str, fix: str) -> None:
        self._add(field, message, fix, self._line(field), "warning")

    def _add(self, field: str | None, message: str, fix: str, line: int | None, severity: Severity) -> None:
        # Messages quote the author's values; a problem must still print as one line.
        self.problems.append(Problem(self.path, _one_line(message), _one_line(fix),
                                     None if field is None else _one_line(field), line, severity))

    def _amend(self, field: str, addition: str) -> None:
        """Add to the message of the problem already reported for ``field``."""
        for index, problem in enumerate(self.problems):
            if problem.field == field:
                self.problems[index] = dataclasses.replace(problem, message=problem.message + _one_line(addition))
                return

    def _line(self, field: str | None) -> int | None:
        while field:
            if field in self.lines:
                return self.lines[field]
            field = field.rpartition(".")[0]
        return None

    def check(self, text: str) -> tuple[Manifest | None, list[Problem]]:
        manifest = self._build(text)
        # In file order; problems about a missing key (no line) come first, as they concern the whole file.
        return manifest, sorted(self.problems, key=lambda problem: problem.line or 0)

    def _build(self, text: str) -> Manifest | None:
        text = normalise(text)
        frontmatter = split_frontmatter(text)
        if frontmatter is None:
            if any(FENCE_RE.match(line) for line in text.split("\n")):
                fix = "remove what comes before the first '---' line: the frontmatter must start on line 1"
            else:
                fix = ("begin the file with a line '---', the keys (name, description, version, ...), "
                       "then a closing '---' line")
            self.error(None, "no YAML frontmatter; start TOOL.md with --- ... ---", fix, line=1)
            return None
        if not frontmatter.closed:
            self.error(None, "the frontmatter is never closed", "add a line holding only '---' after the last key",
                       line=1)
            return None
        size = len(frontmatter.yaml.encode())
        if size > MAX_FRONTMATTER_BYTES:
            self.error(None, f"the frontmatter is {size} bytes, over the limit of {MAX_FRONTMATTER_BYTES}",
                       "keep the frontmatter to metadata and inputs; move long text into the Markdown body",
                       line=1)
            return None
        data = self._load_yaml(frontmatter.yaml)
        if data is None:
            return None

        name = self._name(data)
        description = self._text(data, "description", required=True)
        label = self._text(data, "label", required=False)
        version = self._version(data)
        language = self._language(data)
        inputs = self._inputs(data.get("inputs"))
        permissions = (parse_permissions(data["permissions"], self.error, self.warning) if "permissions" in data
                       else UNDECLARED)
        self._unknown_keys(data)
        body = frontmatter.body.lstrip("\n").rstrip()
        if not body:
            self.warning(None, "TOOL.md has no documentation after the frontmatter",
                         "add a Markdown body (# Title, ## Usage, examples): the agent reads it to use the tool")

        if any(p.is_error for p in self.problems):
            return None
        return Manifest(name=name, label=label or name, description=description, version=version,
                        language=language, inputs=inputs, body=body, path=self.path,
                        permissions=permissions)

    def _load_yaml(self, text: str) -> dict[Any, Any] | None:
        try:
            loader = ManifestLoader(text)  # the reader refuses control characters right here
        except yaml.reader.ReaderError as exc:
            self.error(None, f"the frontmatter holds the control character #x{exc.character:04x}",
                       "delete it (or write it as an escape inside a double-quoted string)",
                       line=text[: exc.position].count("\n") + 2)
            return None
        try:
            node = loader.get_single_node()
            data = loader.construct_document(node) if node is not None else None
        except ParseTimeout as exc:
            self.error(None, f"{exc}, so the tool is skipped",
                       "simplify the frontmatter: a few keys and inputs read in milliseconds", line=1)
            return None
        except Refused as exc:
            line = exc.problem_mark.line + 2 if exc.problem_mark is not None else None
            self.error(None, str(exc.problem), exc.fix, line=line)
            return None
        except yaml.MarkedYAMLError as exc:
            mark = exc.problem_mark or exc.context_mark
            line = mark.line + 2 if mark is not None else None  # +1 for 1-based, +1 for the opening ---
            what = " ".join(str(part) for part in (exc.context, exc.problem) if part)
            self.error(None, f"YAML syntax error: {what}",
                       "fix the YAML at this line; quote values that contain ': ' or start with a special "
                       "character, and indent nested keys consistently", line=line)
            return None
        except (yaml.YAMLError, ValueError, OverflowError, RecursionError) as exc:
            # e.g. a date that does not exist ("2024-13-45") fails in the constructor without a mark
            first_line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            self.error(None, f"YAML error: {first_line}", "fix or quote the offending value", line=1)
            return None
        finally:
            loader.dispose()
        self.lines = _key_lines(node, first_line=2)
        if data is None:
            return {}
        if not isinstance(data, dict):
            self.error(None, f"the frontmatter must be a mapping of keys, got {_describe(data)}",
                       "write one 'key: value' per line (name:, description:, version:, ...)", line=2)
            return None
        return data

    def _name(self, data: dict[Any, Any]) -> str:
        name = data.get("name")
        suggestion = suggest_snake_case(str(name) if name is not None else self.path.parent.name)
        if name is None:
            self.error("name", "name is required", f"add 'name: {suggestion}' to the frontmatter")
        elif not isinstance(name, str):
            self.error("name", f"name must be a string, got {_describe(name)}", f"use 'name: {suggestion}'")
        elif not _NAME_RE.fullmatch(name):
            self.error("name", f"name {name!r} is not snake_case (lowercase letters, digits and _, "
                               "starting with a letter)", f"rename it: 'name: {suggestion}'")
        elif len(name) > MAX_NAME_LENGTH:
            self.error("name", f"name is {len(name)} characters long; model APIs accept at most {MAX_NAME_LENGTH}",
                       "choose a shorter name")
        else:
            return name
        return ""

    def _text(self, data: dict[Any, Any], key: str, *, required: bool) -> str:
        value = data.get(key)
        if value is None:
            if required:
                self.error(key, f"{key} is required",
                           f"add '{key}: <what the tool does and when the agent should use it>'")
            return ""
        if not isinstance(value, str) or not value.strip():
            self.error(key, f"{key} must be non-empty text, got {_describe(value)}",
                       f"write '{key}: ' followed by a sentence (quote it if it contains ': ')")
            return ""
        return value.strip()

    def _version(self, data: dict[Any, Any]) -> int:
        version = data.get("version")
        if version is None:
            self.warning("version", "version is missing, so it counts as 0 and sync will never update this tool",
                         "add 'version: 1' and bump it whenever you change the tool")
            return 0
        if isinstance(version, bool) or not isinstance(version, int):
            shown = version.strip() if isinstance(version, str) and version.strip().isdigit() else "1"
            self.error("version", f"version must be an integer, got {_describe(version)}",
                       f"write a whole number without quotes, e.g. 'version: {shown}'")
            return 0
        return version

    def _language(self, data: dict[Any, Any]) -> str:
        language = data.get("language")
        if language is None:
            return "typescript"
        if isinstance(language, str) and language in LANGUAGES:
            return language
        allowed = ", ".join(LANGUAGES)
        if isinstance(language, str) and language.strip().lower() in LANGUAGES:
            fix = f"write it in lowercase: 'language: {language.strip().lower()}'"
        else:
            fix = "use 'language: typescript' (the default) or remove the key"
        self.error("language", f"language must be one of {allowed}, got {_describe(language)}", fix)
        return ""

    def _unknown_keys(self, data: dict[Any, Any]) -> None:
        for key in data:
            if key in TOP_LEVEL_KEYS:
                continue
            close = difflib.get_close_matches(str(key), TOP_LEVEL_KEYS, n=1)
            fix = f"did you mean '{close[0]}'?" if close else f"remove it (known keys: {', '.join(TOP_LEVEL_KEYS)})"
            self.warning(str(key), f"unknown key {str(key)!r} is ignored", fix)

    # --- inputs ---

    def _inputs(self, raw: Any) -> tuple[Input, ...]:
        if raw is None:
            return ()
        if not isinstance(raw, dict):
            self.error("inputs", f"inputs must be a mapping of parameter names to their specs, got {_describe(raw)}",
                       "write each input as 'name:' with indented 'type:' and 'description:' lines under it")
            return ()
        inputs = []
        for name, spec in raw.items():
            item = self._input(name, spec)
            if item is not None:
                inputs.append(item)
        return tuple(inputs)

    def _input(self, name: Any, spec: Any) -> Input | None:
        field = f"inputs.{name}"
        if not isinstance(name, str):
            self.error(field, f"input name {_describe(name)} is not text", f"quote it: '\"{name}\":'")
            return None
        name_ok = bool(_IDENTIFIER_RE.fullmatch(name))
        if not name_ok:
            self.error(field, f"input name {name!r} is not a valid identifier (letters, digits and _)",
                       f"rename it to '{suggest_snake_case(name)}'")
        if not isinstance(spec, dict):
            example = f"type: {spec}" if isinstance(spec, str) and spec.isidentifier() else "type: string"
            self.error(field, f"input {name!r} must be a mapping with type and description, got {_describe(spec)}",
                       f"write '{name}:' then indented '{example}' and 'description: ...' lines")
            return None

        kind = self._input_type(field, spec)
        description = self._input_description(field, spec)
        optional = self._flag(field, spec, "optional")
        sensitive = self._flag(field, spec, "sensitive")
        values = self._values(field, spec, kind)
        assumed = kind == "string" and spec.get("type") != "string"  # an unknown type, taken as string
        default = self._default(field, spec, kind, values, assumed)
        for key in spec:
            if key not in INPUT_KEYS:
                self._unknown_input_key(field, key)
        if not (name_ok and kind and description and (kind != "enum" or values)):
            return None
        return Input(name=name, type=cast(InputType, kind), description=description, optional=optional, sensitive=sensitive,
                     values=values, default=default)

    def _input_type(self, field: str, spec: dict[Any, Any]) -> str:
        kind = spec.get("type")
        if kind is None:
            self.error(f"{field}.type", "type is required", "add 'type: string' (or number, boolean, enum)")
            return ""
        if not isinstance(kind, str):
            self.error(f"{field}.type", f"type must be one of {', '.join(INPUT_TYPES)}, got {_describe(kind)}",
                       "use 'type: string' (or number, boolean, enum)")
            return ""
        if kind in INPUT_TYPES:
            return kind
        if kind.lower() in ("object", "array"):
            parameter = field.removeprefix("inputs.")
            self.error(f"{field}.type", f"type {kind} is not supported: accept a JSON string and parse it in execute",
                       f"use 'type: string' and JSON.parse(params.{parameter}) in execute")
            return ""
        suggestion = kind.lower() if kind.lower() in INPUT_TYPES else _TYPE_HINTS.get(kind.lower())
        fix = f"use 'type: {suggestion}'" if suggestion else f"use one of {', '.join(INPUT_TYPES)}"
        self.warning(f"{field}.type", f"unknown type {kind!r} is treated as string", fix)
        return "string"

    def _input_description(self, field: str, spec: dict[Any, Any]) -> str:
        description = spec.get("description")
        if description is None:
            self.error(f"{field}.description", "description is required",
                       "add 'description: <what this parameter is for>': the agent reads it")
            return ""
        if not isinstance(description, str) or not description.strip():
            self.error(f"{field}.description", f"description must be non-empty text, got {_describe(description)}",
                       "write a sentence saying what this parameter is for")
            return ""
        return description.strip()

    def _flag(self, field: str, spec: dict[Any, Any], key: str) -> bool:
        value = spec.get(key, False)
        if isinstance(value, bool):
            return value
        self.error(f"{field}.{key}", f"{key} must be true or false, got {_describe(value)}",
                   f"write '{key}: true' or '{key}: false', without quotes")
        return False

    def _values(self, field: str, spec: dict[Any, Any], kind: str) -> tuple[str, ...] | None:
        raw = spec.get("values")
        where = f"{field}.values"
        if kind != "enum":
            if raw is not None:
                self.warning(where, "values is only used by type: enum and is ignored here",
                             "set 'type: enum' or remove values")
            return None
        if raw is None:
            self.error(where, "an enum input needs values",
                       "add 'values: a,b,c' (comma-separated) or a YAML list of the allowed values")
            return None
        if isinstance(raw, str):
            items: list[Any] = [part.strip() for part in raw.split(",")]
        elif isinstance(raw, list):
            items = [item.strip() if isinstance(item, str) else item for item in raw]
        else:
            self.error(where, f"values must be a comma-separated string or a YAML list, got {_describe(raw)}",
                       "write 'values: a,b,c'")
            return None
        values: list[str] = []
        clean = bool(items)
        for item in items:
            if isinstance(item, int) and not isinstance(item, bool):
                item = str(item)  # agents send enum values as strings; 1 means "1"
            if not isinstance(item, str):
                self.error(where, f"each value must be text, got {_describe(item)}", "quote the value")
                clean = False
            elif not item:
                if clean:  # one report is enough for ",,", "a,,b," and the like
                    self.error(where, "values has an empty item", "remove the stray comma or empty list item")
                clean = False
            elif item in values:
                self.warning(where, f"value {item!r} is listed twice", "list each value once")
            else:
                values.append(item)
        if not items:
            self.error(where, "values is empty", "list the allowed values: 'values: a,b,c'")
        return tuple(values) if clean else None

    def _default(self, field: str, spec: dict[Any, Any], kind: str, values: tuple[str, ...] | None,
                 assumed: bool = False) -> Any:
        if "default" not in spec:
            return NO_DEFAULT
        value = spec["default"]
        where = f"{field}.default"
        if value is None:
            self.warning(where, "default is empty, so it is ignored", "give a value or remove 'default:'")
            return NO_DEFAULT
        if kind in ("", "enum") and values is None:
            return NO_DEFAULT  # the type is already reported; a second error would only repeat it
        expected = "a number" if kind == "number" else "true or false" if kind == "boolean" else "text"
        ok = _is_of_kind(value, kind)
        if not ok and assumed:
            # `type: integer` with `default: 5`: the type's warning already names the fix (type: number);
            # "quote the default" would be a second, wrong one. Say the default is dropped in that warning.
            self._amend(f"{field}.type", f", so its default {_describe(value)} is ignored")
            return NO_DEFAULT
        if not ok:
            self.error(where, f"default must be {expected}, got {_describe(value)}", _default_fix(value, kind, expected))
            return NO_DEFAULT
        if kind == "enum" and values is not None and value not in values:
            self.error(where, f"default {value!r} is not one of the values", f"use one of: {', '.join(values)}")
            return NO_DEFAULT
        return value

    def _unknown_input_key(self, field: str, key: Any) -> None:
        if key == "required":
            fix = "inputs are required unless 'optional: true'; remove 'required'"
        elif key in ("enum", "options", "choices"):
            fix = "use 'type: enum' with 'values: a,b,c'"
        else:
            fix = f"remove it (known keys: {', '.join(INPUT_KEYS)})"
        self.warning(f"{field}.{key}", f"unknown key {str(key)!r} is ignored", fix)


def _is_of_kind(value: Any, kind: str) -> bool:
    """Whether a default ``value`` (as YAML read it) is of the input type ``kind``."""
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if kind == "boolean":
        return isinstance(value, bool)
    return isinstance(value, str)


def _default_fix(value: Any, kind: str, expected: str) -> str:
    """The fix for a default of the wrong type: unquote it, quote it, or say what it must be."""
    if isinstance(value, str) and kind in ("number", "boolean") and _reads_as(value, kind):
        return f"write it without quotes: 'default: {value.strip()}'"
    if kind in ("string", "enum") and not isinstance(value, (list, dict)):
        return f"quote it: 'default: \"{_plain(value)}\"'"
    return f"give {expected}"


def _reads_as(text: str, kind: str) -> bool:
    """Whether ``text``, unquoted, would be a YAML value of this input type."""
    try:
        value = yaml.load(text, Loader=ManifestLoader)  # noqa: S506 - a safe loader
    except (yaml.YAMLError, ValueError):
        return False
    if kind == "boolean":
        return isinstance(value, bool)
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def suggest_snake_case(text: str) -> str:
    """A snake_case spelling of ``text`` to offer in a fix ("Web Search" → "web_search")."""
    spaced = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", text)
    spaced = re.sub(r"([A-Z]+)([A-Z][a-z])", r"\1_\2", spaced)
    snake = re.sub(r"[^A-Za-z0-9]+", "_", spaced).strip("_").lower()
    if not snake:
        return "my_tool"
    return snake if snake[0].isalpha() else f"tool_{snake}"


def _one_line(text: str) -> str:
    return " ".join(text.splitlines())


def _plain(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    text = str(value)  # a scalar: str() of a list or mapping could be huge
    return text if len(text) <= 60 else text[:57] + "..."


def _describe(value: Any) -> str:
    """A value as an author would recognise it in their YAML."""
    if value is None:
        return "nothing"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        text = json.dumps(value, ensure_ascii=False)
        return text if len(text) <= 60 else text[:57] + '..."'
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return f"{value} (a {type(value).__name__})"
