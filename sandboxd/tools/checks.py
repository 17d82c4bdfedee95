"""Checks of a tool's entry file for the mistakes TOOLS.md lists under "Common Mistakes".

The source (TypeScript or JavaScript) is read as text. A small tokenizer drops
comments and keeps string, template and regex literals as single tokens, so
nothing inside them can look like code; the checks then match token patterns
and bracket structure (function bodies, ``try`` blocks). It is not a parser:
where the source does something the checks cannot see through (``export *``,
``module.exports = require(...)``), they stay silent rather than guess.

Every finding is a ``Problem`` with the file, the line, what is wrong and the
fix. ``field`` holds the check's id (``execute-export``, ``class-pattern``,
``cli-entry-point``, ``module-exports``, ``console-log``, ``bun-api``,
``throw``) so machines can tell the findings apart.
"""

from __future__ import annotations

import filecmp
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from sandboxd.tools.discovery import ENTRY_FILES
from sandboxd.tools.manifest import MANIFEST_FILE, Problem, read_version

MAX_SOURCE_BYTES = 1 << 20  # the shim loads bigger files, but nobody hand-writes them

EXECUTE_SIGNATURE = "'export async function execute(_toolCallId: string, params: Params): Promise<ToolResult> { ... }'"
EXPORT_FIX = f"export a function named execute: {EXECUTE_SIGNATURE}"

# Keywords after which a "/" starts a regular expression rather than a division.
_REGEX_AFTER_WORDS = frozenset({
    "return", "typeof", "instanceof", "in", "of", "new", "delete", "void", "throw", "case", "do", "else",
    "yield", "await", "export", "default",
})
# Words followed by "(" that are not a function being defined when a "{" follows the ")".
_NOT_METHOD_WORDS = frozenset({
    "if", "for", "while", "switch", "catch", "with", "function", "return", "typeof", "await", "yield", "new",
    "delete", "void", "throw", "case", "in", "of", "instanceof", "super", "import", "else", "do",
})
# Tokens after which a "{" in a type annotation still belongs to the type.
_TYPE_CONTINUES = frozenset({":", "|", "&", "<", ",", "(", "[", "=>", "?", "keyof", "typeof", "readonly", "extends"})
_PUNCTUATORS = ("...", "===", "!==", "=>", "==", "!=", "?.", "++", "--", "&&", "||", "??")
_NAME_RE = re.compile(r"[A-Za-z_$\u0080-\uffff#][\w$\u0080-\uffff]*")
_NUMBER_RE = re.compile(r"(?:0[xXoObB][0-9a-fA-F_]+|(?:\d[\d_]*\.?[\d_]*|\.\d[\d_]*)(?:[eE][+-]?\d+)?)n?")
_SPACE_RE = re.compile(r"[ \t\r\f\v\u00a0\ufeff\u2028\u2029]+")


@dataclass(frozen=True)
class Token:
    kind: str  # name, punct, string, template, regex, number
    text: str  # a string token's text is its raw content, without the quotes
    line: int


# --- tokenizer ---------------------------------------------------------------------------------


def tokenize(source: str) -> list[Token]:
    """JS/TS tokens with their line numbers; comments are dropped. Never raises."""
    tokens: list[Token] = []
    pos, line, end = 0, 1, len(source)
    # One entry per open "{": False for a brace, True for a template's "${", whose "}" resumes the template.
    braces: list[bool] = []
    if source.startswith("#!"):
        pos = source.find("\n")
        pos = end if pos < 0 else pos

    def template(start: int, start_line: int) -> tuple[int, int]:
        """Scan template text from ``start`` (after ` or }) to the closing ` or a "${"."""
        i, ln = start, start_line
        while i < end:
            ch = source[i]
            if ch == "\\":
                ln += source.count("\n", i, i + 2)
                i += 2
                continue
            if ch == "`":
                tokens.append(Token("template", source[start:i], start_line))
                return i + 1, ln
            if ch == "$" and source.startswith("${", i):
                tokens.append(Token("template", source[start:i], start_line))
                braces.append(True)
                return i + 2, ln
            if ch == "\n":
                ln += 1
            i += 1
        tokens.append(Token("template", source[start:], start_line))
        return end, ln

    while pos < end:
        ch = source[pos]
        if ch == "\n":
            line += 1
            pos += 1
            continue
        space = _SPACE_RE.match(source, pos)
        if space:
            pos = space.end()
            continue
        if source.startswith("//", pos):
            newline = source.find("\n", pos)
            pos = end if newline < 0 else newline
            continue
        if source.startswith("/*", pos):
            close = source.find("*/", pos + 2)
            close = end if close < 0 else close + 2
            line += source.count("\n", pos, close)
            pos = close
            continue
        if ch in "'\"":
            i, start_line = pos + 1, line
            while i < end and source[i] != ch and source[i] != "\n":  # an unterminated string ends at the line
                if source[i] == "\\":
                    line += source.count("\n", i + 1, i + 3)  # a line continuation
                    i += 3 if source.startswith("\r\n", i + 1) else 2
                else:
                    i += 1
            tokens.append(Token("string", source[pos + 1: i], start_line))
            pos = i + 1 if i < end and source[i] == ch else i
            continue
        if ch == "`":
            pos, line = template(pos + 1, line)
            continue
        if ch == "}" and braces and braces[-1]:
            braces.pop()
            pos, line = template(pos + 1, line)
            continue
        name = _NAME_RE.match(source, pos)
        if name:
            tokens.append(Token("name", name.group(), line))
            pos = name.end()
            continue
        if ch.isdigit() or (ch == "." and source[pos + 1: pos + 2].isdigit()):
            number = _NUMBER_RE.match(source, pos)
            stop = number.end() if number and number.end() > pos else pos + 1
            tokens.append(Token("number", source[pos:stop], line))
            pos = stop
            continue
        if ch == "/" and _regex_allowed(tokens[-1] if tokens else None):
            stop = _regex_end(source, pos)
            if stop is not None:
                tokens.append(Token("regex", source[pos:stop], line))
                pos = stop
                continue
        text = next((p for p in _PUNCTUATORS if source.startswith(p, pos)), ch)
        if text == "{":
            braces.append(False)
        elif text == "}" and braces:
            braces.pop()
        tokens.append(Token("punct", text, line))
        pos += len(text)
    return tokens


def _regex_allowed(previous: Token | None) -> bool:
    if previous is None:
        return True
    if previous.kind == "punct":
        return previous.text not in (")", "]", "++", "--")  # after "}" a block ended: a regex may follow
    if previous.kind == "name":
        return previous.text in _REGEX_AFTER_WORDS
    return False


def _regex_end(source: str, start: int) -> int | None:
    """End of the regex literal at ``start``, or None when it is not one (it would cross a line end)."""
    i, in_class, end = start + 1, False, len(source)
    while i < end:
        ch = source[i]
        if ch == "\n":
            return None
        if ch == "\\":
            i += 2
            continue
        if ch == "[":
            in_class = True
        elif ch == "]":
            in_class = False
        elif ch == "/" and not in_class:
            i += 1
            while i < end and (source[i].isalnum() or source[i] in "_$"):
                i += 1
            return i
        i += 1
    return None


# --- structure ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Function:
    key: int  # index of the "function" keyword, the "=>", or a method's name
    start: int  # first token of the body ("{" or the expression)
    end: int  # last token of the body ("}" or the expression)

    def contains(self, index: int) -> bool:
        return self.start <= index <= self.end


@dataclass
class Source:
    """Tokens with their bracket pairs, function bodies and try blocks."""

    tokens: list[Token]
    partner: dict[int, int] = field(default_factory=dict)
    functions: list[Function] = field(default_factory=list)
    try_blocks: list[tuple[int, int]] = field(default_factory=list)

    @classmethod
    def parse(cls, text: str) -> Source:
        src = cls(tokenize(text))
        src._pair_brackets()
        src._find_functions()
        src.try_blocks = [(i + 1, src.partner[i + 1]) for i in range(len(src.tokens) - 1)
                          if src.is_word(i, "try") and src.is_punct(i + 1, "{") and i + 1 in src.partner]
        return src

    # token helpers
    def text(self, index: int) -> str | None:
        return self.tokens[index].text if 0 <= index < len(self.tokens) else None

    def is_punct(self, index: int, *texts: str) -> bool:
        return 0 <= index < len(self.tokens) and self.tokens[index].kind == "punct" and self.tokens[index].text in texts

    def is_word(self, index: int, *texts: str) -> bool:
        return 0 <= index < len(self.tokens) and self.tokens[index].kind == "name" and self.tokens[index].text in texts

    def is_name(self, index: int) -> bool:
        return 0 <= index < len(self.tokens) and self.tokens[index].kind == "name"

    def line(self, index: int) -> int:
        return self.tokens[min(index, len(self.tokens) - 1)].line if self.tokens else 1

    def member_access(self, index: int) -> bool:
        """Whether the token at ``index`` is a property (``a.x``, ``a?.x``), not a free name."""
        return self.is_punct(index - 1, ".", "?.")

    def sequence(self, index: int, *texts: str) -> bool:
        """Whether the tokens from ``index`` are exactly ``texts`` (names or punctuation, not literals)."""
        return all(0 <= index + k < len(self.tokens) and self.tokens[index + k].kind in ("name", "punct")
                   and self.tokens[index + k].text == t for k, t in enumerate(texts))

    def _pair_brackets(self) -> None:
        stack: list[int] = []
        closing = {")": "(", "]": "[", "}": "{"}
        for index, token in enumerate(self.tokens):
            if token.kind != "punct":
                continue
            if token.text in "([{":
                stack.append(index)
            elif token.text in closing:
                # Skip unmatched openers (broken code) until the matching kind is found.
                while stack and self.tokens[stack[-1]].text != closing[token.text]:
                    stack.pop()
                if stack:
                    opener = stack.pop()
                    self.partner[opener] = index
                    self.partner[index] = opener

    def _find_functions(self) -> None:
        for index, token in enumerate(self.tokens):
            if token.kind == "name" and token.text == "function" and not self.member_access(index):
                i = index + 1
                if self.is_punct(i, "*"):
                    i += 1
                if self.is_name(i):
                    i += 1
                i = self._skip_generics(i)
                if self.is_punct(i, "(") and i in self.partner:
                    body = self._body_after_params(self.partner[i] + 1)
                    if body is not None:
                        self.functions.append(Function(index, body, self.partner[body]))
            elif token.kind == "punct" and token.text == "=>":
                if self.is_punct(index + 1, "{") and index + 1 in self.partner:
                    self.functions.append(Function(index, index + 1, self.partner[index + 1]))
                elif index + 1 < len(self.tokens):
                    # An expression body ends just before the delimiter that ends its statement.
                    self.functions.append(Function(index, index + 1, max(index + 1, self.statement_end(index + 1) - 1)))
            elif (token.kind == "name" and token.text not in _NOT_METHOD_WORDS and self.is_punct(index + 1, "(")
                  and index + 1 in self.partner and not self.member_access(index)):
                body = self._body_after_params(self.partner[index + 1] + 1)
                if body is not None:  # a method: name(...) { ... }
                    self.functions.append(Function(index, body, self.partner[body]))
        # "function name(...) {" also looks like a method: keep one function per body.
        by_body: dict[int, Function] = {}
        for function in self.functions:
            by_body.setdefault(function.start, function)
        self.functions = sorted(by_body.values(), key=lambda f: f.start)

    def _skip_generics(self, index: int) -> int:
        if not self.is_punct(index, "<"):
            return index
        depth = 0
        for i in range(index, min(len(self.tokens), index + 200)):
            if self.is_punct(i, "<"):
                depth += 1
            elif self.is_punct(i, ">"):
                depth -= 1
                if depth == 0:
                    return i + 1
        return index

    def _body_after_params(self, index: int) -> int | None:
        """The "{" of a body after a parameter list, skipping a return type annotation."""
        if self.is_punct(index, "{"):
            return index if index in self.partner else None
        if not self.is_punct(index, ":"):
            return None
        angle = 0
        i = index + 1
        while i < len(self.tokens) and i < index + 400:
            token = self.tokens[i]
            if token.kind == "punct":
                if token.text == "{":
                    if angle == 0 and self.tokens[i - 1].text not in _TYPE_CONTINUES:
                        return i if i in self.partner else None
                    i = self.partner.get(i, i) + 1
                    continue
                if token.text in "([":
                    i = self.partner.get(i, i) + 1
                    continue
                if token.text == "<":
                    angle += 1
                elif token.text == ">":
                    angle -= 1
                elif angle <= 0 and token.text in (";", "=", ",", ")", "]", "}", "=>"):
                    return None
            i += 1
        return None

    def statement_end(self, index: int) -> int:
        """The first `,` `;` or closing bracket from ``index`` on, skipping bracketed groups;
        ``len(tokens)`` when there is none."""
        i = index
        while i < len(self.tokens):
            if self.is_punct(i, "(", "[", "{") and i in self.partner:
                i = self.partner[i] + 1
                continue
            if self.is_punct(i, ",", ";", ")", "]", "}"):
                return i
            i += 1
        return len(self.tokens)

    # scopes
    def enclosing_function(self, index: int) -> Function | None:
        """The innermost function whose body holds the token at ``index``."""
        best: Function | None = None
        for function in self.functions:
            if function.start > index:
                break
            if function.contains(index) and (best is None or function.start >= best.start):
                best = function
        return best

    def in_try_block(self, index: int, within: Function) -> bool:
        return any(within.start <= start and start < index < end <= within.end for start, end in self.try_blocks)


# --- the checks --------------------------------------------------------------------------------


@dataclass
class _Exports:
    execute_at: int | None = None  # where the execute export is written
    execute_value: int | None = None  # where its function value starts, when it is in this file
    execute_local_name: str | None = None  # export { run as execute }: the local name "run"
    unknown: bool = False  # export *, module.exports = require(...): execute may be exported unseen
    problems: list[tuple[int, str, str, str]] = field(default_factory=list)  # token, check id, message, fix


def check_entry_source(text: str, path: Path) -> list[Problem]:
    """Every finding of the Common Mistakes checks in the entry file's source ``text``."""
    src = Source.parse(text)
    name = path.name
    findings: list[Problem] = []

    def add(index: int | None, check: str, message: str, fix: str, severity: str = "error") -> None:
        line = src.line(index) if index is not None else 1  # about the whole file
        findings.append(Problem(path, message, fix, field=check, line=line, severity=severity))  # type: ignore[arg-type]

    exports = _find_exports(src)
    exported = exports.execute_at is not None
    if not exported and not exports.unknown:
        for index, check, message, fix in exports.problems:
            add(index, check, message, fix)
        if not exports.problems:
            local = _local_definition(src, "execute")
            if local is not None:
                add(local, "execute-export", f"execute is defined but not exported, so the loader cannot find it in {name}",
                    "put 'export' in front of it: 'export async function execute(...)'")
            else:
                add(None, "execute-export", f"{name} does not export a function named execute, "
                    "which is the only thing the loader calls", EXPORT_FIX)

    entry_point_severity = "warning" if exported or exports.unknown else "error"
    for index, snippet in _cli_entry_points(src):
        if snippet == "process.argv":
            message = ("reads process.argv at load time, like a command-line script: a tool never gets "
                       "command-line arguments (process.argv is the sandbox's own)")
        else:
            message = f"a CLI entry point ({snippet}): tools are loaded as modules, never run as a script, so this never runs"
        add(index, "cli-entry-point", message,
            "declare the values as inputs in TOOL.md and read them from execute's params; remove the "
            "command-line code", entry_point_severity)

    bun_guarded = any(src.is_word(i, "typeof") and src.is_word(i + 1, "Bun") for i in range(len(src.tokens)))
    for index, what in _bun_uses(src):
        add(index, "bun-api",
            f"{what}: tools run in Node.js, not Bun, where this throws ReferenceError or fails to load"
            + (" (unless the typeof Bun guard avoids it)" if bun_guarded else ""),
            "use the Node.js standard library: fs.readFileSync/fs.writeFileSync for Bun.file/Bun.write, "
            "setTimeout for Bun.sleep, child_process.spawn/execFileSync for Bun.spawn",
            "warning" if bun_guarded else "error")

    execute = _execute_function(src, exports)
    if execute is not None:
        for index, snippet in _prints_in(src, execute):
            add(index, "console-log",
                f"execute prints with {snippet}: the agent never sees printed output "
                "(it goes to the sandbox's log)",
                "return what the agent should read: 'return ok(text)' or { content: [{ type: 'text', text }] }; "
                "use onUpdate for progress and console.error for debugging logs", "warning")
        for index in _escaping_throws(src, execute):
            add(index, "throw",
                "a throw in execute outside any try block: the agent gets a generic error it cannot act on",
                "return an error result instead, e.g. 'return err(\"what went wrong and what to do\")', or wrap "
                "execute's body in try/catch and return { content: [...], isError: true } from the catch", "warning")
    return sorted(findings, key=lambda p: (p.line or 0))


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
    return check_entry_source(text, path)


def _find_exports(src: Source) -> _Exports:
    out = _Exports()
    tokens = src.tokens
    for i, token in enumerate(tokens):
        if token.kind != "name" or src.member_access(i):
            continue
        word = token.text
        if word == "export":
            _export_statement(src, i, out)
        elif word == "exports" and (value := _execute_property_value(src, i)) is not None:
            out.execute_at, out.execute_value = i, value
        elif word == "module" and src.sequence(i, "module", ".", "exports"):
            if (value := _execute_property_value(src, i + 2)) is not None:
                out.execute_at, out.execute_value = i, value
            elif src.is_punct(i + 3, "="):
                _module_exports_value(src, i, i + 4, out, "module.exports")
    return out


def _execute_property_value(src: Source, i: int) -> int | None:
    """Where the value starts in ``exports.execute = value`` or ``exports["execute"] = value`` (``i``: "exports")."""
    if src.sequence(i + 1, ".", "execute", "="):
        return i + 4
    if (src.is_punct(i + 1, "[") and src.text(i + 2) == "execute" and src.tokens[i + 2].kind == "string"
            and src.is_punct(i + 3, "]") and src.is_punct(i + 4, "=")):
        return i + 5
    return None


def _export_statement(src: Source, i: int, out: _Exports) -> None:
    j = i + 1
    if src.is_word(j, "declare"):
        j += 1
    if src.is_word(j, "async"):
        j += 1
    if src.is_word(j, "function"):
        k = j + 1 + src.is_punct(j + 1, "*")
        if src.is_word(k, "execute"):
            out.execute_at, out.execute_value = i, j
        return
    if src.is_word(j, "const", "let", "var"):
        if src.is_word(j + 1, "execute"):
            out.execute_at, out.execute_value = i, j + 2
        return
    if src.is_word(j, "abstract"):
        j += 1
    if src.is_word(j, "class"):
        class_name = src.text(j + 1) if src.is_name(j + 1) else "a class"
        out.problems.append((i, "class-pattern",
                             f"exports class {class_name} but no execute function: class-based tools are not "
                             "supported, the loader calls a function named execute",
                             f"export a function named execute that does the work (it may use the class): "
                             f"{EXECUTE_SIGNATURE}"))
        return
    if src.is_punct(j, "*"):
        out.unknown = True  # export * from './impl' may carry execute
        return
    if src.is_punct(j, "="):  # TypeScript's "export = value"
        _module_exports_value(src, i, j + 1, out, "export =")
        return
    if src.is_word(j, "default"):
        _default_export(src, i, j + 1, out)
        return
    if src.is_punct(j, "{") and j in src.partner:
        for local, exported in _export_specifiers(src, j + 1, src.partner[j]):
            if exported == "execute":
                out.execute_at = i
                reexport = src.is_word(src.partner[j] + 1, "from")
                out.execute_local_name = None if reexport else local


def _export_specifiers(src: Source, start: int, stop: int) -> list[tuple[str, str]]:
    """(local, exported) names of ``export { a, b as c, type T }`` between the braces."""
    specifiers: list[tuple[str, str]] = []
    i = start
    while i < stop:
        if src.is_word(i, "type") and (src.is_name(i + 1) or src.tokens[i + 1].kind == "string") \
                and not src.is_punct(i + 1, ",", "}"):
            i += 1  # "type Foo" exports a type only
            while i < stop and not src.is_punct(i, ","):
                i += 1
            i += 1
            continue
        if src.is_name(i) or src.tokens[i].kind == "string":
            local = exported = src.tokens[i].text
            if src.is_word(i + 1, "as") and i + 2 < stop:
                exported = src.tokens[i + 2].text
                i += 2
            specifiers.append((local, exported))
        i += 1
    return specifiers


def _default_export(src: Source, at: int, value: int, out: _Exports) -> None:
    if src.is_word(value, "class") or (src.is_word(value, "abstract") and src.is_word(value + 1, "class")):
        message = "exports a class as default but no execute function: class-based tools are not supported"
        out.problems.append((at, "class-pattern", message, EXPORT_FIX))
        return
    function_at = value + 1 if src.is_word(value, "async") else value
    if src.is_punct(value, "{") and _object_has_key(src, value, "execute") not in (None, -1):
        message = "execute is a property of the default export, but the loader looks for an export named execute"
    elif src.is_word(function_at, "function") and src.is_word(function_at + 1, "execute"):
        message = "execute is the default export, but the loader looks for an export named execute"
    else:
        message = "there is a default export but no export named execute, the function the loader calls"
    out.problems.append((at, "execute-export", message, EXPORT_FIX))


def _module_exports_value(src: Source, at: int, value: int, out: _Exports, how: str) -> None:
    """``module.exports = value``: fine when the value is an object with execute."""
    if src.is_punct(value, "{") and value in src.partner:
        key = _object_has_key(src, value, "execute")
        if key == -1:
            out.unknown = True  # a spread: execute may come from it
        elif key is not None:
            out.execute_at, out.execute_value = at, key
        else:
            out.problems.append((at, "module-exports", f"{how} is set to an object without execute",
                                 "add execute to it, or better: " + EXPORT_FIX))
        return
    if src.is_word(value, "class"):
        out.problems.append((at, "class-pattern", f"{how} is set to a class: class-based tools are not supported",
                             EXPORT_FIX))
        return
    if src.is_word(value, "function", "async") or _starts_arrow(src, value):
        out.problems.append((at, "module-exports",
                             f"{how} is set to a function, so there is no execute export",
                             f"export the function by name: {EXECUTE_SIGNATURE}"))
        return
    alone = value + 1 >= len(src.tokens) or src.is_punct(value + 1, ";") \
        or src.tokens[value + 1].line > src.tokens[value].line
    if src.is_name(value) and alone:
        local = src.tokens[value].text
        declared = _local_definition(src, local, kinds=("class",))
        if declared is not None:
            out.problems.append((at, "class-pattern",
                                 f"{how} is set to the class {local}: class-based tools are not supported",
                                 EXPORT_FIX))
            return
    out.unknown = True  # require(...), a variable, new X(): cannot tell from here


def _starts_arrow(src: Source, index: int) -> bool:
    if src.is_punct(index, "(") and index in src.partner:
        after = src.partner[index] + 1
        return src.is_punct(after, "=>") or src.is_punct(after, ":")
    return src.is_name(index) and src.is_punct(index + 1, "=>")


def _object_has_key(src: Source, open_brace: int, key: str) -> int | None:
    """Index of ``key``'s value in the object literal at ``open_brace``; None if absent; -1 if a spread hides it."""
    close = src.partner.get(open_brace)
    if close is None:
        return None
    i, spread = open_brace + 1, False
    while i < close:
        start = i
        while src.is_word(i, "async", "get", "set", "static") and not src.is_punct(i + 1, ":", "(", ",", "}"):
            i += 1
        if src.is_punct(i, "*"):
            i += 1
        if src.is_punct(i, "..."):
            spread = True
        elif src.tokens[i].kind in ("name", "string") and src.tokens[i].text == key:
            if src.is_punct(i + 1, ":"):
                return i + 2
            if src.is_punct(i + 1, "(", ",", "}"):
                return i  # a method or a shorthand
        # Skip to the next property at this level.
        i = max(i, start)
        while i < close and not src.is_punct(i, ","):
            i = src.partner[i] + 1 if src.is_punct(i, "(", "[", "{") and i in src.partner else i + 1
        i += 1
    return -1 if spread else None


def _local_definition(src: Source, name: str, kinds: tuple[str, ...] = ("function", "const", "let", "var", "class")
                      ) -> int | None:
    """Token index of a declaration of ``name`` (``function name``, ``const name``, ``class name``)."""
    for i in range(len(src.tokens) - 1):
        if src.is_word(i, *kinds) and not src.member_access(i):
            k = i + 1 + src.is_punct(i + 1, "*")
            if src.is_word(k, name):
                return i
    return None


def _execute_function(src: Source, exports: _Exports) -> Function | None:
    """The body of the exported execute, when it is defined in this file."""
    start = exports.execute_value
    if start is None and exports.execute_local_name is not None:
        start = _local_definition(src, exports.execute_local_name)
    if start is None:
        return None
    if src.is_name(start) and start + 1 < len(src.tokens) and src.is_punct(start + 1, "(", ",", "}"):
        if src.is_punct(start + 1, ",", "}"):  # shorthand { execute }: the local declaration
            definition = _local_definition(src, src.tokens[start].text)
            if definition is None:
                return None
            start = definition
    # The first function that begins at the definition, before its statement ends.
    stop = src.statement_end(start)
    candidates = [f for f in src.functions if start <= f.key <= stop]
    return min(candidates, key=lambda f: f.key) if candidates else None


def _cli_entry_points(src: Source) -> list[tuple[int, str]]:
    found = []
    comparisons = ("===", "==", "!==", "!=")
    for i in range(len(src.tokens)):
        if src.member_access(i):
            continue
        if src.sequence(i, "require", ".", "main") and src.is_punct(i + 3, *comparisons) \
                and src.is_word(i + 4, "module"):
            found.append((i, f"require.main {src.text(i + 3)} module"))
        elif src.is_word(i, "module") and src.is_punct(i + 1, *comparisons) \
                and src.sequence(i + 2, "require", ".", "main"):
            found.append((i, f"module {src.text(i + 1)} require.main"))
        elif src.sequence(i, "import", ".", "meta", ".", "main"):
            found.append((i, "import.meta.main"))
        elif src.sequence(i, "process", ".", "argv") and src.enclosing_function(i) is None:
            found.append((i, "process.argv"))  # outside any function: a script's arguments
    return found


def _bun_uses(src: Source) -> list[tuple[int, str]]:
    found = []
    for i, token in enumerate(src.tokens):
        if token.kind == "name" and token.text == "Bun" and src.is_punct(i + 1, ".", "[") \
                and not src.member_access(i):
            member = src.text(i + 2) if src.is_punct(i + 1, ".") and src.is_name(i + 2) else ""
            found.append((i, f"uses the Bun API Bun.{member}" if member else "uses the Bun API"))
        elif token.kind == "string" and (token.text == "bun" or token.text.startswith("bun:")):
            imported = src.is_word(i - 1, "from") or (src.is_punct(i - 1, "(") and src.is_word(i - 2, "require", "import"))
            if imported:
                found.append((i, f"imports the Bun module '{token.text}'"))
    return found


_PRINTS = (("console", ".", "log"), ("console", ".", "info"), ("process", ".", "stdout", ".", "write"))


def _prints_in(src: Source, execute: Function) -> list[tuple[int, str]]:
    """console.log / console.info / process.stdout.write anywhere in execute's body."""
    found = []
    for i in range(execute.start, execute.end + 1):
        if src.member_access(i):
            continue
        printer = next((p for p in _PRINTS if src.sequence(i, *p)), None)
        if printer is not None:
            found.append((i, "".join(printer)))
    return found


def _escaping_throws(src: Source, execute: Function) -> list[int]:
    """throw statements of execute itself (not of functions inside it) that no try block encloses."""
    found = []
    for i in range(execute.start, execute.end + 1):
        if src.is_word(i, "throw") and not src.member_access(i) and src.enclosing_function(i) == execute \
                and not src.in_try_block(i, execute):
            found.append(i)
    return found


# --- the synced copy ---------------------------------------------------------------------------

MAX_COMPARED_FILES = 2000  # beyond this, only TOOL.md and the entry files are compared


def check_synced_copy(tool_dir: Path, data_path: Path) -> list[Problem]:
    """"Bump version": the tool differs from its synced copy in DATA_PATH/tools, which sync will keep.

    Sync copies a seed tool only when its version is higher than the installed
    one's (TOOLS.md, "How Sync Works"), so an edit without a bump never arrives.
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
