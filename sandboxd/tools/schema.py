"""inputSchema (docs/protocol.md) from a manifest, and call arguments checked against it.

Arguments are coerced the way pi's validator does it (AJV with
``coerceTypes: true``, https://ajv.js.org/coercion.html), so a tool receives
the same values here as under pi:

    to number:  "5" → 5, " 12 " → 12, "0x10" → 16, true → 1, false → 0, null → 0
                ("" and "abc" are refused; so are NaN and ±Infinity, which JSON cannot carry)
    to string:  5 → "5", 1e21 → "1e+21", true → "true", null → ""
    to boolean: "true"/1 → true, "false"/0/null → false ("1", "yes" are refused)

Arrays and objects are never coerced. Missing arguments that have a
``default`` get it (as AJV's ``useDefaults``), before ``required`` is checked.
"""

from __future__ import annotations

import copy
import json
import math
import re
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from sandboxd.errors import InvalidParams
from sandboxd.tools.manifest import Input, Manifest

_JSON_TYPES = {"string": "string", "number": "number", "boolean": "boolean", "enum": "string"}
_MAX_SHOWN = 60  # characters of a value quoted in an error message


def input_schema(manifest: Manifest) -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of the tool's arguments, exactly as docs/protocol.md describes it."""
    return {
        "type": "object",
        "properties": {item.name: _property(item) for item in manifest.inputs},
        "required": [item.name for item in manifest.inputs if not item.optional],
        "additionalProperties": False,
    }


def _property(item: Input) -> dict[str, Any]:
    prop: dict[str, Any] = {"type": _JSON_TYPES[item.type]}
    if item.type == "enum":
        prop["enum"] = list(item.values or ())
    prop["description"] = item.description
    if item.has_default:
        prop["default"] = item.default
    if item.sensitive:
        prop["writeOnly"] = True
    return prop


def sensitive_names(schema: dict[str, Any]) -> set[str]:
    """Names of the arguments whose values must never be shown or logged."""
    return {name for name, prop in schema.get("properties", {}).items() if prop.get("writeOnly")}


@dataclass(frozen=True)
class Violation:
    argument: str | None  # None when the arguments as a whole are wrong
    message: str

    def to_dict(self) -> dict[str, Any]:
        return {"argument": self.argument, "message": self.message}


def validate_arguments(schema: dict[str, Any], arguments: object, *, tool: str | None = None) -> dict[str, Any]:
    """Return a coerced copy of ``arguments`` with defaults filled in.

    Raises InvalidParams naming every violation at once; ``data`` lists them.
    Values of writeOnly (sensitive) arguments never appear in the message.
    """
    return ArgumentsCheck(schema, tool)(arguments)


class ArgumentsCheck:
    """validate_arguments for one schema, with what each call needs of the schema looked up once
    (a Tool keeps one: a warm call checks its arguments without reading the schema again)."""

    def __init__(self, schema: dict[str, Any], tool: str | None = None) -> None:
        self.tool = tool
        self._properties: dict[str, dict[str, Any]] = schema.get("properties", {})
        self._required = schema.get("required", ())
        self._closed = schema.get("additionalProperties", True) is False

    def __call__(self, arguments: object) -> dict[str, Any]:
        if not isinstance(arguments, dict):
            raise _invalid(self.tool, [Violation(None, f"arguments must be an object, got {_json_type(arguments)}")])
        violations: list[Violation] = []
        result: dict[str, Any] = {}
        for name, prop in self._properties.items():
            if name in arguments:
                value = arguments[name]
            elif "default" in prop:
                value = copy.deepcopy(prop["default"])
            else:
                if name in self._required:
                    violations.append(Violation(name, f"{_quote(name)} is required ({_expected(prop)})"))
                continue
            coerced = coerce(value, prop["type"])
            if coerced is _INVALID:  # the value is encoded for the message only when it is wrong
                shown = f"a {_json_type(value)}" if prop.get("writeOnly") else _show(value)
                violations.append(Violation(name, f"{_quote(name)} must be {_a(prop['type'])}, got {shown}"))
            elif "enum" in prop and coerced not in prop["enum"]:
                shown = "another value" if prop.get("writeOnly") else _show(coerced)
                violations.append(Violation(name, f"{_quote(name)} must be one of {_choices(prop)}, got {shown}"))
            else:
                result[name] = coerced
        if not self._properties.keys() >= arguments.keys():  # names it does not declare (one look, in C)
            self._extra(arguments, result, violations)
        if violations:
            raise _invalid(self.tool, violations)
        return result

    def _extra(self, arguments: dict[str, Any], result: dict[str, Any], violations: list[Violation]) -> None:
        for name in arguments:
            if name in self._properties:
                continue
            if self._closed:
                known = ", ".join(self._properties) or "none: it takes no arguments"
                violations.append(Violation(name, f"{_quote(name)} is not an input of this tool (inputs: {known})"))
            else:
                result[name] = copy.deepcopy(arguments[name])


def _invalid(tool: str | None, violations: list[Violation]) -> InvalidParams:
    prefix = f"invalid arguments for tool {json.dumps(tool)}" if tool else "invalid arguments"
    message = f"{prefix}: " + "; ".join(v.message for v in violations)
    return InvalidParams(message, data=[v.to_dict() for v in violations])


# --- coercion (AJV coerceTypes: true) ----------------------------------------------------------


class _Invalid:
    def __repr__(self) -> str:
        return "INVALID"


_INVALID: Any = _Invalid()
# ECMAScript's StrWhiteSpaceChar: what Number("  5  ") trims.
_JS_SPACE = "\t\n\v\f\r \u00a0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a" \
            "\u2028\u2029\u202f\u205f\u3000\ufeff"
_DECIMAL_RE = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
_RADIX_RE = {16: re.compile(r"0[xX][0-9a-fA-F]+"), 8: re.compile(r"0[oO][0-7]+"), 2: re.compile(r"0[bB][01]+")}
_EXACT_INTEGERS = 2**53


def coerce(value: Any, json_type: str) -> Any:
    """``value`` as ``json_type`` after AJV's coercion, or the _INVALID marker."""
    if json_type == "string":
        if isinstance(value, str):
            return value
        if isinstance(value, bool):
            return "true" if value else "false"
        if isinstance(value, (int, float)):
            return js_number_to_string(value) if _finite(value) else _INVALID
        return "" if value is None else _INVALID
    if json_type == "number":
        if isinstance(value, bool):
            return int(value)
        if isinstance(value, (int, float)):
            return value if _finite(value) else _INVALID
        if value is None:
            return 0
        return _number_from_string(value) if isinstance(value, str) else _INVALID
    if json_type == "boolean":
        if isinstance(value, bool):
            return value
        if value in ("true", "false"):
            return value == "true"
        if isinstance(value, (int, float)) and value in (0, 1):
            return value == 1
        return False if value is None else _INVALID
    raise ValueError(f"unsupported schema type {json_type!r}")


def _finite(number: int | float) -> bool:
    """Whether a JavaScript number can hold it: an integer of 400 digits is Infinity there."""
    try:
        return math.isfinite(number)
    except OverflowError:  # an int too large for a double
        return False


def _number_from_string(text: str) -> Any:
    """JavaScript's +text, accepted only where AJV accepts it (non-empty, and +text == text)."""
    if not text:
        return _INVALID
    body = text.strip(_JS_SPACE)
    if not body:
        return 0  # JavaScript: +"  " is 0, and AJV takes it
    for radix, pattern in _RADIX_RE.items():
        if pattern.fullmatch(body):
            return _tidy(int(body[2:], radix))
    if _DECIMAL_RE.fullmatch(body):
        return _tidy(float(body))
    return _INVALID  # including "Infinity": JSON cannot carry it to the tool


def _tidy(number: int | float) -> Any:
    if isinstance(number, float):
        if not math.isfinite(number):
            return _INVALID  # "1e999"
        if number.is_integer() and abs(number) <= _EXACT_INTEGERS:
            return int(number)  # "5.0" → 5, as JavaScript has one number type
    return number


def js_number_to_string(number: int | float) -> str:
    """JavaScript's String(number) (ECMAScript Number::toString), e.g. 1e21 → "1e+21", 1e-7 → "1e-7"."""
    if isinstance(number, int) and abs(number) <= _EXACT_INTEGERS:
        return str(number)
    value = float(number)
    if value == 0:
        return "0"
    sign = "-" if value < 0 else ""
    # repr gives the shortest digits that round-trip, as JavaScript does.
    parts = Decimal(repr(abs(value))).as_tuple()
    point = len(parts.digits) + int(parts.exponent)  # value = 0.DIGITS × 10^point
    digits = "".join(map(str, parts.digits)).rstrip("0")
    if len(digits) <= point <= 21:
        return sign + digits + "0" * (point - len(digits))
    if 0 < point <= 21:
        return sign + digits[:point] + "." + digits[point:]
    if -6 < point <= 0:
        return sign + "0." + "0" * -point + digits
    exponent = point - 1
    mantissa = digits if len(digits) == 1 else digits[0] + "." + digits[1:]
    return f"{sign}{mantissa}e{'+' if exponent >= 0 else '-'}{abs(exponent)}"


# --- wording -----------------------------------------------------------------------------------


def _quote(name: str) -> str:
    return _truncate(json.dumps(name, ensure_ascii=False))


def _show(value: Any) -> str:
    try:
        return _truncate(json.dumps(value, ensure_ascii=False, allow_nan=False))
    except ValueError:  # NaN or Infinity from a lenient JSON decoder
        return repr(value)
    except RecursionError:  # nested almost as deep as the parser allows
        return f"a deeply nested {_json_type(value)}"


def _truncate(text: str) -> str:
    return text if len(text) <= _MAX_SHOWN else text[: _MAX_SHOWN - 1] + "…"


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, (list, tuple)):
        return "array"
    return "object" if isinstance(value, dict) else type(value).__name__


def _a(json_type: str) -> str:
    return {"string": "a string", "number": "a number", "boolean": "true or false"}.get(json_type, json_type)


def _choices(prop: dict[str, Any]) -> str:
    return ", ".join(json.dumps(v, ensure_ascii=False) for v in prop["enum"])


def _expected(prop: dict[str, Any]) -> str:
    kind = f"one of {_choices(prop)}" if "enum" in prop else prop["type"]
    description = prop.get("description")
    return f"{kind}: {description}" if description else kind
